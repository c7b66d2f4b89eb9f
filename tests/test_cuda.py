"""The CUDA tier: lossless generation, tree attention and training through accelerate on a GPU.

    python -m pytest -q -m cuda        # every test here; each is skipped, with the reason, where no GPU is present

The lossless checks are the CPU suite's own (tests/test_generation.py), run on the GPU at its half-precision dtypes,
each compared with transformers' ``generate`` at the same dtype.
"""

from __future__ import annotations

import copy
import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from griffin import DraftModel
from griffin.family import output_logits, verification_mask
from griffin.kv_cache import BufferCache, cached_forward
from griffin.target import target_fingerprint
from griffin.tree import build_tree
from tests.conftest import run_module, tiny_model
from tests.test_batch import check_rows_identity
from tests.test_eagle3 import check_fused_identity
from tests.test_generation import check_eos_and_budget, check_greedy_identity, check_sampling_distribution
from tests.test_training import synthetic_items
from training.store import shard_name, write_manifest, write_shard

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = "cuda"
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


# --- lossless generation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_identical_to_generate_on_the_gpu(family, dtype):
    check_greedy_identity(family, CUDA, dtype)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), *HALF])
def test_eos_and_budget_on_the_gpu(dtype):
    check_eos_and_budget(CUDA, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_heads_greedy_identical_to_generate_on_the_gpu(family, dtype):
    check_fused_identity(family, CUDA, dtype)


@pytest.mark.parametrize("rows", [2, 4, 8])
def test_every_batch_row_equals_its_own_generation_on_the_gpu(rows):
    """fp32, where a row's tokens cannot depend on the batch's rounding."""
    check_rows_identity("llama", rows, CUDA)


def test_sampling_matches_the_target_distribution_on_the_gpu():
    # each run is a whole generation of launch-bound tiny kernels (tens of ms on a GPU): fewer runs than on a CPU
    check_sampling_distribution(1.0, 0.9, CUDA, torch.bfloat16, runs=3000)


# --- tree attention --------------------------------------------------------------------------------------------------


def branching_tree(vocab: int, root: int, device: str, seed: int = 0):
    """A 12-node tree below ``root`` that branches at several depths (4 nodes at depth 1, 3 children each, ...)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1] * 4 + [0, 0, 0, 1, 1, 1, 2, 2, 3] + [4, 4, 5, 7, 9, 10])
    levels = torch.tensor([1] * 4 + [2] * 9 + [3] * 6)
    scores = torch.zeros(len(parents))
    for i, parent in enumerate(parents.tolist()):  # falling along every path
        scores[i] = (scores[parent] if parent >= 0 else 0.0) - torch.rand((), generator=gen) - 0.01
    tokens = torch.randint(0, vocab, (len(parents),), generator=gen)
    return build_tree(*(t.to(device) for t in (torch.tensor([root]), tokens, scores, parents, levels)),
                      total_tokens=12)


@torch.inference_mode()
def tree_logits(model, context: torch.Tensor, tree) -> torch.Tensor:
    """One verification pass over ``tree`` after ``context`` (tree mask through the model's attention) -> [N+1, V]."""
    decoder, dtype, p = model.get_decoder(), model.lm_head.weight.dtype, context.shape[0]
    cache = BufferCache(model.config.num_hidden_layers, p + tree.size)
    causal = torch.ones(p, p, dtype=torch.bool, device=context.device).tril()
    cached_forward(decoder, cache, input_ids=context[None], position_ids=torch.arange(p, device=context.device)[None],
                   attention_mask=verification_mask(model, 0, causal, dtype))
    hidden = cached_forward(decoder, cache, input_ids=tree.tokens[None], position_ids=(p + tree.depths)[None],
                            attention_mask=verification_mask(model, p, tree.ancestors, dtype)).last_hidden_state[0]
    return output_logits(model, hidden).float()


def check_tree_attention(device: str, dtype: torch.dtype) -> None:
    """Every tree node gets the logits of a causal forward over its own root-to-node path, and the model's SDPA
    attention gives what its eager attention gives."""
    sdpa = tiny_model("llama", vocab_size=96).to(device=device, dtype=dtype)
    eager = copy.deepcopy(sdpa)
    eager.config._attn_implementation = "eager"
    context = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(1)).to(device)
    tree = branching_tree(96, root=7, device=device)
    assert tree.depths.max() == 3 and tree.size == 13
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.1}
    got = tree_logits(sdpa, context, tree)
    torch.testing.assert_close(got, tree_logits(eager, context, tree), **tol)
    with torch.inference_mode():
        for node in range(tree.size):
            path = tree.ancestors[node].nonzero().squeeze(1)  # root .. node
            want = sdpa(torch.cat((context, tree.tokens[path]))[None]).logits[0, -1].float()
            torch.testing.assert_close(got[node], want, **tol, msg=lambda m, node=node: f"node {node}: {m}")


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), *HALF])
def test_tree_attention_sdpa_equals_eager_and_each_path(dtype):
    check_tree_attention(CUDA, dtype)


# --- training through accelerate on one GPU ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_store(tmp_path_factory) -> Path:
    """A feature store of a tiny target's own greedy continuations, written directly (no tokenizer needed)."""
    folder = tmp_path_factory.mktemp("cuda-store")
    target = tiny_model(vocab_size=60, hidden=32)
    target.save_pretrained(folder / "target")
    items = synthetic_items(target, 24, 24)
    stats = {"num_records": len(items), "num_samples": len(items), "skipped": {},
             "num_tokens": sum(len(c.input_ids) for c in items),
             "num_loss_tokens": int(sum(int(c.loss_mask.sum()) for c in items))}
    store = folder / "features"
    write_shard(store / shard_name(0), items, stats, 60, 32, torch.float16)
    build = {"format": "griffin-features/1", "target": str(folder / "target"), "hidden_size": 32, "vocab_size": 60,
             "target_fingerprint": target_fingerprint(AutoConfig.from_pretrained(folder / "target")),
             "max_len": 64, "dtype": "float16"}
    write_manifest(store, build, [shard_name(0)])
    return store


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def train(store: Path, out: Path, precision: str, launcher: list[str] | None = None, env: dict | None = None):
    res = run_module("training.train", "--features", str(store), "--out", str(out), "--steps", "2", "--batch-size",
                     "4", "--max-updates", "3", "--noise", "0", "--lr", "1e-3", "--mixed-precision", precision,
                     "--topk", "0", launcher=launcher, env=env, timeout=300)  # no token mask: pass 2 keeps positions
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    report = json.loads((out / "validation.json").read_text())
    assert report["run"]["mixed_precision"] == precision and report["run"]["processes"] == 1
    passes = report["epochs"][-1]["passes"]
    assert len(passes) == 2 and all(p["positions"] > 0 and torch.isfinite(torch.tensor(p["loss"])) for p in passes)
    DraftModel.from_pretrained(out)  # a loadable head
    return res


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_training_on_one_gpu_plain_ddp_launch_and_fsdp(gpu_store, tmp_path):
    """One process on the GPU three ways, same global batch: plain, under torchrun (accelerate's MULTI_GPU state: NCCL
    process group and reductions; with one process it does not wrap the model in DDP) and under accelerate's FSDP
    launcher (FSDP wraps the objective). All three end with the same weights; FSDP also trains under bf16 autocast."""
    train(gpu_store, tmp_path / "plain", "no")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", free_port(),
                "-m"]
    res = train(gpu_store, tmp_path / "ddp", "no", torchrun, env={"NCCL_DEBUG": "INFO"})
    assert "NCCL INFO" in res.stdout + res.stderr  # reductions went through an NCCL communicator
    assert_same_weights(tmp_path / "plain", tmp_path / "ddp")
    for precision in ("no", "bf16"):
        fsdp = [sys.executable, "-m", "accelerate.commands.launch", "--use_fsdp", "--fsdp_version", "1",
                "--num_processes", "1", "--num_machines", "1", "--main_process_port", free_port(), "-m"]
        out = tmp_path / f"fsdp-{precision}"
        train(gpu_store, out, precision, fsdp)
        assert any("fsdp" in p.name for p in (out / "train_state").iterdir())  # accelerate saved FSDP state
    assert_same_weights(tmp_path / "plain", tmp_path / "fsdp-no")
