"""Model names that may be Hugging Face Hub ids: ``org/name`` (pinned with ``revision=`` or as ``org/name@revision``)
resolves to its folder in the Hub cache, fetched on first use by ``huggingface_hub`` as transformers'
``from_pretrained`` would.

A local folder of the same spelling wins when it exists. The Hub's own settings apply: ``HF_HUB_OFFLINE=1`` (only the
cache is read), ``HF_HUB_CACHE`` / ``HF_HOME`` (where the cache is) and ``HF_TOKEN`` or ``hf auth login`` (gated and
private models). A model that is neither cached nor reachable is one error naming it and how to fetch it.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from huggingface_hub import constants  # light; the download machinery loads on first use (commands parse at once)

Kind = Literal["target", "draft head", "draft LM"]

# What each kind needs from its repository: configs, tokenizer files and the weights the loaders read (safetensors for
# language models, whose repositories often hold the same weights again as .bin, .pth or GGUF; official heads are .bin)
_LM_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py"]
_HEAD_FILES = ["*.json", "*.safetensors", "*.bin"]
_SAFETENSORS_INDEX = "model.safetensors.index.json"


def hub_id(name: str | os.PathLike) -> tuple[str, str | None] | None:
    """``org/name`` or ``org/name@revision`` -> (repository id, revision or None); None for anything else."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo, _, revision = str(name).partition("@")
    if repo.count("/") != 1 or "@" in revision or (revision == "" and "@" in str(name)):
        return None
    try:
        validate_repo_id(repo)
    except HFValidationError:
        return None
    return repo, revision or None


def resolve(name_or_path: str | os.PathLike, *, kind: Kind, revision: str | None = None,
            token: str | bool | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local folder of a model: ``name_or_path`` itself when it exists (or is no Hub id, for the caller to report),
    else the Hub model's snapshot in the cache, fetching what ``kind`` needs unless ``HF_HUB_OFFLINE`` is set."""
    path = Path(name_or_path).expanduser()
    parsed = hub_id(name_or_path)
    if path.exists() or parsed is None:
        return path
    repo, pinned = parsed
    if pinned and revision and pinned != revision:
        raise ValueError(f"{name_or_path} names revision {pinned!r} but revision={revision!r} was passed: pass one")
    revision = pinned or revision
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:  # the configs first, then the weights of that same commit (folder.name) unless they are there already
        folder = _snapshot(repo, _LM_FILES if kind != "draft head" else ["config.json"], revision, token, cache_dir)
        if kind == "draft head":
            _check_head(folder, repo)
            weights, present = _HEAD_FILES, any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
        else:
            index = folder / _SAFETENSORS_INDEX
            weights = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
                "*.safetensors"]
            present = all(any(folder.glob(w)) for w in weights)
        if not present:  # (a cached model skips the Hub's file listing, which retries for about 20 s when unreachable)
            folder = _snapshot(repo, weights, folder.name, token, cache_dir)
    except (LocalEntryNotFoundError, HfHubHTTPError) as err:
        raise _hub_error(err, str(name_or_path), repo, revision, kind, cache_dir) from None
    if kind != "draft head" and not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(f"the Hub model {repo} has no safetensors weights, the only kind griffin loads for a "
                                f"{kind}: convert it (save_pretrained writes safetensors) and pass the folder")
    return folder


def model_argument(kind: Kind) -> Callable[[str], str]:
    """An argparse type for a command's model flag: with ``HF_HUB_OFFLINE`` set, a Hub id missing from the cache is
    refused while the arguments are parsed (one line, before torch loads); the name is returned as given."""

    def parse(text: str) -> str:
        if constants.is_offline_mode() and not Path(text).expanduser().exists() and hub_id(text):
            try:
                resolve(text, kind=kind)
            except ValueError as err:  # argparse would replace a ValueError's message by its own
                raise argparse.ArgumentTypeError(str(err)) from None
        return text

    parse.__name__ = kind
    return parse


def _check_head(folder: Path, repo: str) -> None:
    """Refuse a whole language model named as a draft head before its weights are downloaded (heads have one layer;
    this package's own record their ``arch``)."""
    config = folder / "config.json"
    raw = json.loads(config.read_text()) if config.is_file() else {}
    layers = raw.get("num_hidden_layers", 1) if isinstance(raw, dict) and "arch" not in raw else 1
    if isinstance(layers, int) and layers > 1:
        raise ValueError(f"the Hub model {repo} has {layers} layers: it is a language model, not a draft head (pass it "
                         "as the target, or as draft_model / --student for a standalone draft LM)")


def _snapshot(repo: str, patterns: list[str], revision: str | None, token: str | bool | None,
              cache_dir: str | os.PathLike | None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, revision=revision, token=token, cache_dir=cache_dir, allow_patterns=patterns,
                                  local_files_only=constants.is_offline_mode()))


def _hub_error(err: Exception, name: str, repo: str, revision: str | None, kind: Kind,
               cache_dir: str | os.PathLike | None) -> OSError:
    """One line saying what is wrong with a Hub model and how to fix it."""
    from huggingface_hub.errors import (
        GatedRepoError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    fetch = f"`hf download {repo}" + (f" --revision {revision}`" if revision else "`")
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(err, IncompleteSnapshotError):
        return FileNotFoundError(f"the Hub cache holds an incomplete copy of {repo}{at}: fetch it again with {fetch}")
    if isinstance(err, LocalEntryNotFoundError):
        offline = constants.is_offline_mode()
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub cannot be reached"
        return FileNotFoundError(f"{name} is not a local folder, and the Hub model {repo}{at} is not in the local Hub "
                                 f"cache ({cache_dir or constants.HF_HUB_CACHE}) while {why}: fetch it where the Hub "
                                 f"is reachable with {fetch}" + (" or unset HF_HUB_OFFLINE" if offline else ""))
    if isinstance(err, GatedRepoError):
        return PermissionError(f"the Hub model {repo} is gated: accept its terms on {constants.ENDPOINT}/{repo}, "
                               f"then {login}")
    if isinstance(err, RepositoryNotFoundError):
        return FileNotFoundError(f"{name} is neither a local folder nor a {kind} on the Hugging Face Hub (a private "
                                 f"model needs a login: {login})")
    if isinstance(err, RevisionNotFoundError):
        return FileNotFoundError(f"the Hub model {repo} has no revision {revision!r}")
    status = getattr(getattr(err, "response", None), "status_code", "?")
    return PermissionError(f"the Hugging Face Hub refused {repo} (HTTP {status}): {login}")
