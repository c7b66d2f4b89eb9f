"""The recipe's schedule as data: the heads, their stages and learning rates, and how records become chunks."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

LR = {1: 1e-3, 2: 6e-4, 3: 6e-4}  # peak learning rate of the first chunk of each stage
LR_DECAY = 0.85  # per chunk within a stage
REGEN_LR = 0.3  # the peak rate of a chunk of the target's answers, relative to LR[stage] * LR_DECAY**i
DRAFT_VOCAB = 8192  # the heads' draft vocabulary of a new recipe
SCHEDULE = ("lr", "lr_decay", "regen_lr", "regen_records", "draft_vocab")  # a rerun may change (for the chunks to come)


@dataclass(frozen=True)
class Head:
    name: str  # its folder under --checkpoints is wip-<name>
    label: str  # the method's name in the card
    arch: str
    steps: tuple[int, int, int]  # K in stages 1, 2, 3 (training-time-test heads: the passes scored)
    topk: int
    parent: str | None = None  # the stage-1 head it forks from at stage 2
    ttt: int = 0  # training-time test over this many passes instead of K (the EAGLE-3 generation)
    mask_until: int | None = None  # the alignment mask (topk) trains the chunks before this one only; None: all


def training_topk(head: Head, chunk: int) -> int:
    """The alignment mask's top-k ``head`` trains on ``chunk`` with (0: every pass on every position). Scoring on the
    fixed sets keeps ``head.topk`` for the whole curve, so that its points stay comparable."""
    return head.topk if head.mask_until is None or chunk < head.mask_until else 0


STAGE1 = [Head("griffin-s1", "GRIFFIN (stage 1, K=1)", "griffin", (1, 1, 1), 3),
          Head("eagle-s1", "EAGLE (stage 1, K=1)", "eagle", (1, 1, 1), 3)]


HEADS = [Head("griffin", "GRIFFIN", "griffin", (1, 2, 3), 3, "griffin-s1"),
         Head("griffin-k1", "GRIFFIN w/o TAT", "griffin", (1, 1, 1), 3, "griffin-s1"),
         Head("eagle-tat", "GRIFFIN w/o TAD", "eagle", (1, 2, 3), 3, "eagle-s1"),
         Head("hass", "HASS", "eagle", (1, 2, 3), 0, "eagle-s1"),
         Head("eagle2", "EAGLE-2", "eagle", (1, 1, 1), 3, "eagle-s1")]


# The EAGLE-3 generation (``--generation 3``): fused features of three target layers, training-time test over 7
# passes from the first chunk, one head per architecture and no fork; scored on the fixed sets over 3 passes.
# griffin3 trained chunks 0-9 with GRIFFIN's top-3 alignment mask and trains without it from chunk 10 on: on this
# base the mask costs first-guess accuracy, and dropping it from the trained head costs no acceptance
# (docs/training.md).
GEN3 = [Head("eagle3", "EAGLE-3", "eagle3", (3, 3, 3), 0, ttt=7),
        Head("griffin3", "GRIFFIN on EAGLE-3 (TGF + dual heads, TTT; top-3 alignment mask in chunks 0-9 only)",
             "griffin3", (3, 3, 3), 3, ttt=7, mask_until=10)]


def settings(args: argparse.Namespace, records: int) -> dict:
    shards = math.ceil(records / args.shard_records)
    chunks = math.ceil(shards / args.chunk_shards) * (2 if args.regen_records else 1)
    total = sum(args.fractions)
    ends = [round(chunks * sum(args.fractions[: s + 1]) / total) for s in range(3)]
    return {"generation": args.generation, "target": args.target, "data": args.data, "records": records,
            "shard_records": args.shard_records,
            "shards": shards, "chunk_shards": args.chunk_shards, "chunks": chunks, "stage_ends": ends,
            "regen_records": min(math.ceil(args.regen_records / args.shard_records) * args.shard_records,
                                 args.chunk_shards * args.shard_records),
            "regen_new_tokens": args.regen_new_tokens, "max_len": args.max_len, "draft_vocab": args.draft_vocab,
            "batch_size": args.batch_size, "lr": LR, "lr_decay": LR_DECAY, "regen_lr": REGEN_LR}


def stage_of(cfg: dict, chunk: int) -> int:
    return next(s + 1 for s, end in enumerate(cfg["stage_ends"]) if chunk < end)


def heads_of(cfg: dict, stage: int) -> list[Head]:
    if cfg["generation"] == 3:
        return GEN3
    return STAGE1 if stage == 1 else HEADS


def final_heads(cfg: dict) -> list[Head]:
    """The heads the recipe ships."""
    return GEN3 if cfg["generation"] == 3 else HEADS


def all_heads(cfg: dict) -> list[Head]:
    return GEN3 if cfg["generation"] == 3 else STAGE1 + HEADS


def peak_lr(cfg: dict, chunk: int) -> float:
    """Chunk i of a stage peaks at ``LR[stage] * LR_DECAY**i``, times ``REGEN_LR`` for a chunk of the target's answers
    (a cosine schedule with warm-up inside each chunk)."""
    stage = stage_of(cfg, chunk)
    index = chunk - (cfg["stage_ends"][stage - 2] if stage > 1 else 0)
    return LR[stage] * LR_DECAY ** index * (REGEN_LR if chunk_source(cfg, chunk)[0] == "regen" else 1)


def chunk_source(cfg: dict, chunk: int) -> tuple[str, range]:
    """-> ("sharegpt" or "regen", the shard range of its group of records). With regeneration, chunk 2g holds the
    ShareGPT conversations of group g and chunk 2g+1 the target's answers to the first turns of its first records."""
    kinds = 2 if cfg["regen_records"] else 1
    group, kind = divmod(chunk, kinds)
    first = group * cfg["chunk_shards"]
    return ("sharegpt", "regen")[kind], range(first, min(first + cfg["chunk_shards"], cfg["shards"]))


def fixed_sets(cfg: dict) -> dict[str, int]:
    """The fixed validation sets -> the chunk whose held-out conversations they are: ShareGPT's (chunk 0) and, with
    regeneration, the target's own answers (chunk 1), the text a head drafts at inference."""
    return {"sharegpt": 0, "regen": 1} if cfg["regen_records"] else {"sharegpt": 0}
