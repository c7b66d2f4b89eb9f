"""The feature store: sharded safetensors files of packed tokens, memory-mapped when read.

Layout of a store folder::

    build.json                  settings the store is built with (a rerun with other settings is refused)
    shard-00000.safetensors     input_ids int32 [N], loss_mask uint8 [N], hidden fp16|bf16 [N, H],
                                layers fp16|bf16 [N, 3H] and argmax int32 [N] (with feature_layers: the inputs of
                                three target layers, which EAGLE-3-generation heads read, and the target's top token),
                                offsets int64 [n+1] (conversation j is rows offsets[j]:offsets[j+1]),
                                token_counts int64 [V] (assistant-token frequencies); per-shard stats in metadata
    manifest.json               written last: the store is complete only when it exists

Shard ``i`` holds the usable conversations among records ``[i*S, (i+1)*S)``, so a store's content does not depend on
how many processes built it, and a killed run resumes by skipping the shards that exist (each is renamed into place
only once fully written).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from griffin.io import atomic_write, atomic_write_json, open_safetensors, read_json

MANIFEST = "manifest.json"
BUILD = "build.json"
STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class StoreError(ValueError):
    pass


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class Conversation:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8
    hidden: torch.Tensor  # [T, H] storage dtype
    layers: torch.Tensor | None = None  # [T, 3H] storage dtype, the inputs of the store's feature_layers
    argmax: torch.Tensor | None = None  # [T] int32, the target's top token after each position (with layers)


def write_shard(path: Path, items: list[Conversation], stats: dict[str, Any], vocab_size: int, hidden_size: int,
                dtype: torch.dtype, layered: bool = False) -> None:
    lengths = torch.tensor([0] + [len(c.input_ids) for c in items], dtype=torch.long)
    if items:
        ids = torch.cat([c.input_ids for c in items])
        mask = torch.cat([c.loss_mask for c in items])
        hidden = torch.cat([c.hidden for c in items]).to(dtype)
    else:
        ids, mask = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.uint8)
        hidden = torch.zeros(0, hidden_size, dtype=dtype)
    counts = torch.bincount(ids[mask.bool()], minlength=vocab_size)
    tensors = {
        "input_ids": ids.to(torch.int32).contiguous(),
        "loss_mask": mask.contiguous(),
        "hidden": hidden.contiguous(),
        "offsets": torch.cumsum(lengths, 0),
        "token_counts": counts,
    }
    if layered:
        tensors["layers"] = torch.cat([c.layers for c in items]).to(dtype).contiguous() if items else torch.zeros(
            0, 3 * hidden_size, dtype=dtype)
        tensors["argmax"] = torch.cat([c.argmax for c in items]).contiguous() if items else torch.zeros(
            0, dtype=torch.int32)
    meta = {"stats": json.dumps(stats)}
    atomic_write(path, lambda p: save_file(tensors, str(p), metadata=meta))


class DamagedShard(StoreError):
    """A shard file that does not read back; ``problem`` says what is wrong with it."""

    def __init__(self, problem: str):
        super().__init__(f"{problem}: rerun build_features with the same --out to rebuild it")
        self.problem = problem


def open_shard(path: Path):
    """A shard's safetensors handle; a truncated, corrupted or foreign file raises DamagedShard naming it."""
    try:
        handle = open_safetensors(path)
    except ValueError as err:
        raise DamagedShard(f"feature shard {err}") from None
    missing = sorted({"input_ids", "loss_mask", "hidden", "offsets", "token_counts"} - set(handle.keys()))
    if missing or "stats" not in (handle.metadata() or {}):
        raise DamagedShard(f"{path} is not a feature shard (missing {missing or 'its stats'})")
    return handle


def read_shard_stats(path: Path) -> dict[str, Any]:
    with open_shard(path) as handle:
        return json.loads(handle.metadata()["stats"])


def link_view(source: Path, shards: Sequence[int], folder: Path, data: str, hard: bool = False) -> Path:
    """A store at ``folder`` whose shards 0, 1, ... link to shards ``shards`` of the complete or partial store
    ``source`` (symbolic links; ``hard``: hard links, which outlive the source's deletion), with its build record
    (``data`` naming what the view holds). Built beside ``folder`` and renamed into place, so that a killed run never
    leaves a view that looks complete."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i, shard in enumerate(shards):
        target = (source / shard_name(shard)).resolve()
        (tmp / shard_name(i)).hardlink_to(target) if hard else (tmp / shard_name(i)).symlink_to(target)
    build = json.loads((source / BUILD).read_text()) | {"max_samples": None, "data": data}
    atomic_write_json(tmp / BUILD, build)
    write_manifest(tmp, build, [shard_name(i) for i in range(len(shards))])
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def write_manifest(folder: Path, build: dict[str, Any], shard_files: list[str]) -> dict[str, Any]:
    """Aggregate the shards' stats into manifest.json (atomically)."""
    totals: dict[str, Any] = {"num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0, "num_records": 0}
    skipped: dict[str, int] = {}
    shards = []
    for name in shard_files:
        stats = read_shard_stats(folder / name)
        for key in totals:
            totals[key] += stats[key]
        for reason, count in stats["skipped"].items():
            skipped[reason] = skipped.get(reason, 0) + count
        shards.append({"file": name, "num_samples": stats["num_samples"], "num_tokens": stats["num_tokens"]})
    manifest = {**build, **totals, "skipped": skipped, "num_skipped": sum(skipped.values()), "shards": shards}
    atomic_write_json(folder / MANIFEST, manifest)
    return manifest


class FeatureStore:
    """Read access to a complete store: ``store[i]`` -> :class:`Conversation` (hidden states memory-mapped)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        path = self.folder / MANIFEST
        if not path.is_file():
            hint = " (its build did not finish: rerun build_features with the same --out to resume)" if (
                self.folder / BUILD).is_file() else ""
            raise StoreError(f"{self.folder} is not a feature store: {MANIFEST} is missing{hint}")
        try:
            self.manifest = read_json(path, "store manifest")
        except ValueError as err:
            raise StoreError(str(err)) from None
        self._handles = []
        self._index: list[tuple[int, int, int]] = []  # (shard, start, end) per conversation
        for s, shard in enumerate(self.manifest["shards"]):
            if not (self.folder / shard["file"]).is_file():
                raise StoreError(f"{self.folder / shard['file']} is missing: rebuild the store")
            handle = open_shard(self.folder / shard["file"])
            offsets = handle.get_tensor("offsets").tolist()
            self._handles.append(handle)
            self._index += [(s, offsets[j], offsets[j + 1]) for j in range(len(offsets) - 1)]

    def __len__(self) -> int:
        return len(self._index)

    @property
    def hidden_size(self) -> int:
        return self.manifest["hidden_size"]

    @property
    def feature_layers(self) -> list[int] | None:
        """The target layers whose inputs the store holds (``layers``), or None (last hidden states only)."""
        return self.manifest.get("feature_layers")

    def length(self, i: int) -> int:
        _, start, end = self._index[i]
        return end - start

    def __getitem__(self, i: int) -> Conversation:
        s, start, end = self._index[i]
        handle = self._handles[s]
        return Conversation(
            input_ids=handle.get_slice("input_ids")[start:end].long(),
            loss_mask=handle.get_slice("loss_mask")[start:end],
            hidden=handle.get_slice("hidden")[start:end],
            layers=handle.get_slice("layers")[start:end] if self.feature_layers else None,
            argmax=handle.get_slice("argmax")[start:end].long() if "argmax" in handle.keys() else None,
        )

    def items(self, indices: list[int]) -> list[Conversation]:
        """Conversations ``indices`` (the interface :class:`training.online.OnlineFeatures` shares)."""
        return [self[i] for i in indices]

    def loss_mask(self, i: int) -> torch.Tensor:
        """Conversation ``i``'s loss mask [T] alone (no hidden states read)."""
        s, start, end = self._index[i]
        return self._handles[s].get_slice("loss_mask")[start:end]

    def token_counts(self) -> torch.Tensor:
        """Frequency of every token id among the assistant tokens of the store [V]."""
        return sum(h.get_tensor("token_counts") for h in self._handles)
