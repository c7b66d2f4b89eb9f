"""The recipe's record, recipe.json: settings, the chunks each head has consumed, the learning curve and the
seconds of every step; and the tables of the README beside it."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from griffin.io import atomic_write_json, atomic_write_text

from ..data import iter_records
from ..store import StoreError
from .schedule import DRAFT_VOCAB, SCHEDULE, Head, all_heads, chunk_source, final_heads, fixed_sets, stage_of

STATE = "recipe.json"


def count_records(work: Path, data: str) -> int:
    path = work / "records.json"
    if path.is_file() and json.loads(path.read_text())["data"] == data:
        return json.loads(path.read_text())["records"]
    n = sum(1 for _ in iter_records(data))
    atomic_write_json(path, {"data": data, "records": n})
    return n


def chunks_done(state: dict, head: Head) -> int:
    """Chunks consumed by ``head``; a stage-2 head that has not started yet has consumed its parent's."""
    done = state["heads"].get(head.name, {}).get("chunks")
    if done is not None:
        return len(done)
    return len(state["heads"].get(head.parent, {}).get("chunks", [])) if head.parent else 0


def load_state(path: Path, cfg: dict) -> dict:
    """The record at ``path`` checked against ``cfg`` (a new one if there is none). ``cfg["draft_vocab"]`` None (no
    --draft-vocab) becomes the record's, or the default of a new recipe; a record's vocabulary can grow, not shrink."""
    if not path.is_file():
        cfg["draft_vocab"] = DRAFT_VOCAB if cfg["draft_vocab"] is None else cfg["draft_vocab"]
        return {"settings": cfg, "heads": {}, "curve": [], "timings": []}
    state = json.loads(path.read_text())
    state["settings"].setdefault("generation", 2)  # records from before --generation
    if bool(state["settings"]["regen_records"]) != bool(cfg["regen_records"]):
        raise StoreError(f"{path} was made {'with' if state['settings']['regen_records'] else 'without'} regenerated "
                         "answers: rerun with --regen-records "
                         f"{'above' if state['settings']['regen_records'] else 'equal to'} 0, or use a new "
                         "--checkpoints folder to start over")
    old = {k: v for k, v in state["settings"].items() if k not in SCHEDULE}
    new = {k: v for k, v in cfg.items() if k not in SCHEDULE}
    if old != new:
        diff = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        raise StoreError(f"{path} was made with other settings ({', '.join(diff)} differ): rerun with the same "
                         "options, or use a new --checkpoints folder to start over")
    for row in state["timings"]:  # rows from before --regen-records could change: the settings' count
        if row["kind"] == "regen":
            row.setdefault("regen_records", state["settings"]["regen_records"])
    kept = state["settings"]["draft_vocab"]
    if cfg["draft_vocab"] is None:  # set only for a record that is used
        cfg["draft_vocab"] = kept
    elif cfg["draft_vocab"] != kept and not 0 < kept < cfg["draft_vocab"]:
        raise StoreError(f"{path}'s heads propose {kept or 'all'} tokens and --draft-vocab {cfg['draft_vocab']} "
                         f"would not widen that: rerun without --draft-vocab, or with more than {kept} tokens")
    state["settings"] |= {k: cfg[k] for k in SCHEDULE}  # the schedule of the chunks to come
    return state


DATA_COSTS = ("regenerate_s", "regen_engines", "features_s")  # what a chunk's data build writes into its row


def add_seconds(timing: dict, key: str, seconds: float, fresh: bool) -> None:
    """A step's seconds into its chunk's row: added to the row's (a step resumed by a later run on this machine), or
    in its place where the step started from nothing (the row's came from a machine whose work was lost)."""
    timing[key] = round(seconds) + (0 if fresh else timing.get(key, 0))


def chunk_timing(state: dict, cfg: dict, chunk: int) -> dict:
    """The chunk's row of ``state["timings"]``, added (in chunk order) when the recipe first reaches the chunk."""
    for row in state["timings"]:
        if row["chunk"] == chunk:
            return row
    row = {"chunk": chunk, "kind": chunk_source(cfg, chunk)[0], "stage": stage_of(cfg, chunk), "train_s": {}}
    state["timings"] = sorted(state["timings"] + [row], key=lambda r: r["chunk"])
    return row


def consumed_text(state: dict, head: Head) -> str:
    if head.name in state["heads"] or head.parent is None:
        return str(chunks_done(state, head))
    return f"not started (forks from {head.parent} at stage 2)"


def figure(value: float | None, digits: int) -> str:
    """A validation figure; null when nothing was measured (no position left at that pass)."""
    return "-" if value is None else f"{value:.{digits}f}"


def progress_markdown(cfg: dict, state: dict) -> str:
    """README of the --checkpoints folder: what each head has consumed and its learning curve."""
    from griffin.report import markdown_table

    heads = markdown_table(["head", "chunks consumed", "of"], [[h.name, consumed_text(state, h), cfg["chunks"]]
                                                              for h in all_heads(cfg)])
    kinds = list(fixed_sets(cfg))
    curve = markdown_table(["head", "chunk", "K", "peak LR", "tokens seen"]
                           + [f"fixed {k}: top-1 per pass" for k in kinds]
                           + ["chunk's held-out: top-1 per pass", "kept per pass"],
                           [[r["head"], r["chunk"], r["steps"], f"{r['lr']:.3g}" if "lr" in r else "-",
                             f"{r['tokens_seen']:,}",
                             *(" / ".join(figure(p["top1"], 3) for p in r.get("fixed", {}).get(k, [])) or "-"
                               for k in kinds),
                             " / ".join(figure(p["top1"], 3) for p in r["passes"]),
                             " / ".join(figure(p["kept"], 2) for p in r["passes"])] for r in state["curve"]])
    times = markdown_table(["chunk", "data", "stage", "conversations", "tokens", "precision", "regenerate s",
                            "features s", "training s per head (updates)"],
                           [[t["chunk"], t["kind"], t["stage"], t.get("conversations", "-"),
                             f"{t['tokens']:,}" if "tokens" in t else "-",
                             # rows from before --precision (built, no precision): always bf16; not built yet: -
                             t.get("precision", "bf16" if "features_s" in t else "-"),
                             f"{t['regenerate_s']}{step_notes(t, 'data', t.get('regen_engines', []))}"
                             if "regenerate_s" in t else "-",
                             f"{t['features_s']}{step_notes(t, 'data')}" if "features_s" in t else "-",
                             ", ".join(f"{k} {v}{step_notes(t, k)}" for k, v in t["train_s"].items())]
                            for t in state["timings"]])
    finished = all(chunks_done(state, h) >= cfg["chunks"] for h in final_heads(cfg))
    title = ("# The recipe's heads (complete: `python -m training.recipe --promote` ships them)" if finished
             else "# Heads in training (work in progress)")
    return (f"{title}\n\nWritten by `python -m training.recipe` after every chunk; "
            f"`recipe.json` holds the same and is what a rerun continues from. {plan_text(cfg, state)}\n\n"
            f"{heads}\n## Learning curve\n\nValidation top-1 against training tokens seen. The fixed sets are the same "
            "for every point, so they give the learning curve: `fixed sharegpt` is chunk 0's held-out ShareGPT "
            "conversations, `fixed regen` chunk 1's held-out answers of the target (the text a head drafts at "
            "inference); no head trains on these conversations, though a first turn of one may reach training with "
            "the other kind of answer (their records: `fixed-val-*.jsonl`). Each chunk's own held-out 5 % changes "
            f"with the chunk's data.\n\n{curve}\n"
            "## Time per chunk on this machine\n\nEvery step on one thread, except those that name their threads "
            "(`--threads`): a training's are those of the run that finished it, a chunk's data steps' those of the run "
            f"that built them ahead or reached the chunk.\n\n{times}")


def step_notes(timing: dict, step: str, notes: Sequence[str] = ()) -> str:
    """`` (2 threads)`` where the run of ``step`` (a head's training, or ``"data"``: the chunk's regeneration and
    features) on the chunk had more than one thread, else ``""``; ``notes`` (the regeneration's engines) join it."""
    n = timing.get("data_threads", 1) if step == "data" else timing.get("train_threads", {}).get(step, 1)
    said = ([f"{n} threads"] if n > 1 else []) + list(notes)
    return f" ({', '.join(said)})" if said else ""


def save_state(path: Path, cfg: dict, state: dict) -> None:
    """recipe.json and the README beside it."""
    atomic_write_json(path, state)
    atomic_write_text(path.with_name("README.md"), progress_markdown(cfg, state))


def plan_text(cfg: dict, state: dict) -> str:
    groups = math.ceil(cfg["shards"] / cfg["chunk_shards"])
    return (f"{cfg['records']} records, {cfg['shards']} shards, {groups} groups of {cfg['chunk_shards']} shards, "
            f"{cfg['chunks']} chunks (ShareGPT{' and regenerated answers' if cfg['regen_records'] else ''}); stages "
            f"end at chunks {cfg['stage_ends']}; {cfg['regen_records']} regenerated first turns per group from "
            "now on; chunks "
            "consumed: " + ", ".join(f"{h.name} {consumed_text(state, h)}" for h in all_heads(cfg)) + ".")
