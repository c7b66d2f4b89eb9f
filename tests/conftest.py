"""Shared fixtures: tiny random-config targets (fast) and the embedded SmolLM2 target (a few end-to-end tests)."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare
from transformers import (
    AutoTokenizer,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from griffin.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent
# two threads for the embedded target, one where pytest-xdist runs a worker per core (make test)
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With GRIFFIN_PRINT_FAILURES=1, a failure's report is written the moment it happens (a run stopped at its time
    limit, as on a lent GPU machine, then still shows why each test failed; pytest itself reports at the end)."""
    if report.failed and os.environ.get("GRIFFIN_PRINT_FAILURES") == "1":
        print(f"\nFAILED {report.nodeid} ({report.when}):\n{report.longreprtext}\n", file=sys.__stderr__, flush=True)


@pytest.fixture(autouse=True)
def _threads(request):
    """Two threads for the embedded target; one for tiny models, whose many small ops only pay for thread syncs."""
    big = {"embedded", "smol_generator"} & set(request.fixturenames)
    torch.set_num_threads(THREADS if big else 1)
    yield


@pytest.fixture(autouse=True)
def _fresh_accelerator():
    """An in-process training run starts as a new process would: accelerate's global state (mixed precision, device)
    is reset after every test."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM), "gemma2": (Gemma2Config, Gemma2ForCausalLM),
            "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM), "granite": (GraniteConfig, GraniteForCausalLM),
            "cohere": (CohereConfig, CohereForCausalLM)}


def tiny_model(family: str = "llama", vocab_size: int = 128, seed: int = 0, hidden: int = 64, layers: int = 2,
               **config):
    """A random-weight causal LM with GQA (4 query heads, 2 KV heads); ``config`` overrides its config fields."""
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
                  tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(**(common | config))
    config._attn_implementation = "sdpa" if model_cls._supports_sdpa else "eager"  # Gemma-2: eager only
    model = model_cls(config).eval().requires_grad_(False)
    # larger logits make greedy choices clear and sampling distributions non-uniform
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="session")
def smol_path() -> Path:
    from griffin.target import embedded_target_path

    return embedded_target_path()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    return AutoTokenizer.from_pretrained(smol_path)


@pytest.fixture(scope="session")
def embedded():
    from griffin import load_target

    return load_target("smollm2-135m-instruct", dtype="fp32")


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved as a local HF folder."""
    folder = tmp_path_factory.mktemp("tiny-target")
    model = tiny_model("llama", vocab_size=len(smol_tokenizer), hidden=32, layers=2)
    model.save_pretrained(folder)
    smol_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory, tiny_target_dir) -> Path:
    """An untrained head saved for the tiny target."""
    from transformers import AutoConfig

    from griffin import DraftConfig, DraftModel

    folder = tmp_path_factory.mktemp("head")
    torch.manual_seed(0)
    DraftModel(DraftConfig.from_target(AutoConfig.from_pretrained(tiny_target_dir))).save_pretrained(folder)
    return folder


def run_module(module: str, *args: str, launcher: list[str] | None = None, timeout: int = 600,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` (or under a launcher) and capture its output."""
    cmd = (launcher or [sys.executable, "-m"]) + [module, *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=full_env)


def run_main(module: str, *args: str) -> tuple[int, str]:
    """Run a command's ``main`` in this process as its ``__main__`` would: -> (exit code, what it printed to stderr).

    For the error paths of commands, which a subprocess per case would make slow."""
    mod = importlib.import_module(module)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = run_cli(mod.main, getattr(mod, "INPUT_ERRORS", ()), list(args))
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code
    return code, err.getvalue()


def pooled_chisquare(counts: dict, exact: dict, runs: int) -> tuple[float, int]:
    """Chi-square of sampled ``counts`` against ``exact`` probabilities over ``runs`` draws: -> (p-value, cells).

    Outcomes expected fewer than 5 times are pooled into one cell, where the test's normal approximation holds."""
    observed, expected, rest_o, rest_e = [], [], 0, 0.0
    for cell in sorted(exact, key=exact.get, reverse=True):
        e = exact[cell] * runs
        if e >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(e)
        else:
            rest_o += counts.get(cell, 0)
            rest_e += e
    if rest_e > 0:
        observed.append(rest_o)
        expected.append(rest_e)
    total = sum(expected)  # the exact table may be cut (top-k walks): rescale to the draws
    return chisquare(observed, [e * runs / total for e in expected]).pvalue, len(observed)


def fake_result(bench: str, draft: str, temperature: float, tau: float, digest: str = "") -> dict:
    return {"bench": bench, "target": "smollm2-135m-instruct", "draft": draft, "draft_digest": digest,
            "temperature": temperature,
            "max_new_tokens": 128, "n_prompts": 80, "tau": tau, "tokens_per_s": 30.0, "speedup": 2.0,
            "baseline_tokens_per_s": 15.0, "own_loop_tokens_per_s": 20.0, "peers": {"prompt_lookup": 1.1},
            "prompt_lookup_tokens_per_s": 18.0,
            "identical_fraction": 1.0,
            "tree": {"depth": 5, "top_k": 8, "total_tokens": 24}, "command": f"python -m inference.speed {bench}",
            "machine": {"cpu": "Intel(R) Xeon(R) Processor", "cores": 2, "torch": "2.13", "date": "today",
                        "torch_threads": 1},
            "per_prompt": [{"question_id": q, "turn": 0, "tau": t, "ours": {"new_tokens": 100 * t}, "cycles": 100}
                           for q, t in ((1, tau - 0.1), (2, tau + 0.1))]}  # standard error 0.1
