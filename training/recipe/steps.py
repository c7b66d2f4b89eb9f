"""What a chunk runs: the target's answers, the features, each head's training, scoring on the fixed validation sets
and export, and the files that let a rerun resume them."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

from griffin.io import atomic_write_json, atomic_write_text

from ..data import iter_records
from ..regenerate import part_cost_file, part_file
from ..store import MANIFEST, StoreError, link_view, shard_name
from . import scheduler
from .progress import add_seconds, chunk_timing, chunks_done
from .schedule import Head, all_heads, chunk_source, fixed_sets, heads_of, peak_lr, stage_of, training_topk

ANSWERS = "regen-answers"  # in --checkpoints: the target's answers of the chunks some head has yet to train on


def resolve_precision(precision: str) -> str:
    """``--precision`` -> "bf16" or "fp32". auto is bf16 only where the hardware computes it: on an AVX2-only EPYC
    bf16 built features at 25 tokens/s against 156 in fp32 (``pipeline-throughput-avx2``), while with AVX512-BF16
    bf16 was 1.6x faster (``pipeline-throughput``)."""
    import torch

    if precision != "auto":
        return precision
    native = torch.cuda.is_available() or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return "bf16" if native else "fp32"


def autocast(args) -> str:
    """training's and evaluate's --mixed-precision for the recipe's dtype."""
    return "bf16" if args.dtype == "bf16" else "no"


def run_folder(args, head: str, chunk: int) -> Path:
    """Where ``head``'s training on ``chunk`` runs (on this machine only)."""
    return Path(args.work) / "runs" / head / f"chunk-{chunk:03d}"


def regen_file(args, chunk: int) -> Path:
    return Path(args.work) / "regen-chunks" / f"chunk-{chunk:03d}.jsonl"


def answers_file(args, chunk: int) -> Path:
    """The committed copy of a chunk's answers (``regen_file``), kept until every head has trained on the chunk, so
    that a fresh machine does not regenerate them (chunk 21's 1024 records: 2133 s, ``recipe.json``)."""
    return Path(args.checkpoints) / ANSWERS / f"chunk-{chunk:03d}.jsonl"


def answers_part(args, part: int) -> Path:
    """The committed copy of a finished regeneration part of a chunk whose answers are not merged yet
    (``keep_parts``), so that a fresh machine answers only the parts still missing (256 first turns: about 9 minutes
    here)."""
    return part_file(Path(args.checkpoints) / ANSWERS, part)


def keep_parts(args, cfg: dict, state: dict) -> None:
    """Before a commit: copy into --checkpoints the finished regeneration parts of this machine whose chunk some head
    has yet to train on and whose merged answers are not committed (``regenerated`` removes them once they are)."""
    for chunk in range(cfg["chunks"]):
        kind, shards = chunk_source(cfg, chunk)
        if kind != "regen" or answers_file(args, chunk).is_file() or all(
                chunks_done(state, h) > chunk for h in heads_of(cfg, stage_of(cfg, chunk))):
            continue
        out, kept = Path(args.work) / "regen", Path(args.checkpoints) / ANSWERS
        for part in shards:
            if part_file(out, part).is_file() and not part_file(kept, part).is_file():
                copy_part(out, kept, part)


def copy_part(src: Path, dst: Path, part: int) -> None:
    """A finished answers part and its cost file (if any) from folder ``src`` to ``dst``, the part last: its file says
    the copy is complete."""
    for name in (part_cost_file, part_file):
        if name(src, part).is_file():
            atomic_write_text(name(dst, part), name(src, part).read_text())


def answered_cost(args, cfg: dict, shards: range, records: int) -> dict | None:
    """What the target took to answer a chunk's parts (the first turns of its group's first ``records`` records), from
    their cost files on this machine, whichever run answered them: ``regenerate_s``, their seconds summed, and
    ``regen_engines``, the engines that answered them (a cost file without one is from before the recipe chose an
    engine: transformers ``generate``). None where a cost file is missing (parts answered elsewhere, or before costs
    were recorded)."""
    parts = min(math.ceil(records / cfg["shard_records"]), len(shards))
    costs = [part_cost_file(Path(args.work) / "regen", i) for i in range(shards.start, shards.start + parts)]
    if not all(c.is_file() for c in costs):
        return None
    costs = [json.loads(c.read_text()) for c in costs]
    return {"regenerate_s": round(sum(c["seconds"] for c in costs)),
            "regen_engines": sorted({c.get("engine", "generate") for c in costs})}


def regenerated(args, cfg: dict, chunk: int, shards: range, records: int, timing: dict | None = None) -> Path:
    """The target's answers to the first turns of the group's first ``records`` records, as one JSONL file (also
    copied to ``answers_file``); ``timing`` gets the sum of its parts' seconds and their engines (``answered_cost``),
    or the seconds of the run here where a part has none. (``run_chunk`` sets the sum again once the chunk is built,
    for answers that a run which then stopped had finished.)"""
    merged, committed = regen_file(args, chunk), answers_file(args, chunk)
    if not merged.is_file() and committed.is_file():
        merged.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(committed, merged)
    if not merged.is_file():
        parts = min(math.ceil(records / cfg["shard_records"]), len(shards))
        out = Path(args.work) / "regen"
        files = [part_file(out, i) for i in range(shards.start, shards.start + parts)]
        fresh = not any(f.is_file() for f in files)
        kept = Path(args.checkpoints) / ANSWERS
        for i, f in enumerate(files, shards.start):  # parts another machine finished and committed
            if not f.is_file() and part_file(kept, i).is_file():
                copy_part(kept, out, i)
        seconds = scheduler.python("training.regenerate", "--target", cfg["target"], "--data", cfg["data"], "--out",
                                   str(out), "--parts", f"{shards.start}:{shards.start + parts}", "--part-size",
                                   str(cfg["shard_records"]), "--dtype", args.dtype, "--batch-size",
                                   str(args.regen_batch), "--max-new-tokens", str(cfg["regen_new_tokens"]),
                                   "--engine", args.regen_engine)
        if timing is not None:
            cost = answered_cost(args, cfg, shards, records)
            if cost is not None:  # every part's own seconds, whichever run or machine answered it
                timing.update(cost)
            else:  # parts answered before their cost was recorded: this run's seconds
                add_seconds(timing, "regenerate_s", seconds, fresh)
        text = "".join(f.read_text() for f in files)
        atomic_write_text(merged, text)
    if not committed.is_file():
        atomic_write_text(committed, merged.read_text())
    for i in shards:  # the merged answers stand for their parts now
        answers_part(args, i).unlink(missing_ok=True)
        part_cost_file(Path(args.checkpoints) / ANSWERS, i).unlink(missing_ok=True)
    return merged


def chunk_records(state: dict, cfg: dict, chunk: int) -> int:
    """First turns the target answers for ``chunk`` (0 for a ShareGPT chunk): ``regen_records`` of the run that first
    reached it, kept in its row of timings, so that a rerun with another --regen-records ends a chunk as it began."""
    if chunk_source(cfg, chunk)[0] != "regen":
        return 0
    return chunk_timing(state, cfg, chunk).setdefault("regen_records", cfg["regen_records"])


def layers(cfg: dict) -> list[str]:
    """build_features' option for the features the recipe's heads read (the EAGLE-3 generation: three layers)."""
    return ["--feature-layers", "auto"] if cfg["generation"] == 3 else []


def build_chunk(args, cfg: dict, chunk: int, timing: dict, records: int = 0) -> Path:
    """-> the chunk's feature store (built here unless it exists); the seconds of each step go to ``timing`` (a
    chunk's row of ``recipe.json``'s timings, ``add_seconds``); ``records``: the first turns answered for a chunk of
    the target's answers (``chunk_records``)."""
    kind, shards = chunk_source(cfg, chunk)
    common = ["--target", cfg["target"], "--max-len", str(cfg["max_len"]), "--dtype", args.dtype, *layers(cfg)]
    if kind == "regen":
        store = Path(args.work) / "regen-features" / f"chunk-{chunk:03d}"
        if not (store / MANIFEST).is_file():
            regen = regenerated(args, cfg, chunk, shards, records, timing)
            fresh = not any(store.glob("shard-*"))
            seconds = scheduler.python("training.build_features", "--data", str(regen), "--out", str(store), *common)
            add_seconds(timing, "features_s", seconds, fresh)
        return store
    view = Path(args.work) / "chunks" / f"chunk-{chunk:03d}"  # links to the chunk's shards of the shared store
    if (view / MANIFEST).is_file():
        return view
    sharegpt = Path(args.sharegpt_store)
    fresh = not any((sharegpt / shard_name(shard)).is_file() for shard in shards)
    seconds = scheduler.python("training.build_features", "--data", cfg["data"], "--out", str(sharegpt), "--shards",
                               f"{shards.start}:{shards.stop}", "--shard-size", str(cfg["shard_records"]), *common)
    add_seconds(timing, "features_s", seconds, fresh)
    return link_view(sharegpt, shards, view, f"{cfg['data']} shards {shards.start}..{shards.stop - 1}")


def prune_features(args, cfg: dict, chunk: int) -> None:
    """Delete ``chunk``'s features (its regenerated answers' store, or its shards of the shared ShareGPT store and the
    view linking them) once no head will read them again: three target layers take 3.2 GB per ShareGPT chunk here, so
    36 chunks would not fit on the disk. The fixed validation sets have their own stores and stay. A head trained
    again on the chunk (a new head, a lost run) rebuilds them."""
    if args.keep_features:
        return
    kind, shards = chunk_source(cfg, chunk)
    if kind == "regen":
        shutil.rmtree(Path(args.work) / "regen-features" / f"chunk-{chunk:03d}", ignore_errors=True)
        return
    shutil.rmtree(Path(args.work) / "chunks" / f"chunk-{chunk:03d}", ignore_errors=True)  # the view first
    for shard in shards:
        (Path(args.sharegpt_store) / shard_name(shard)).unlink(missing_ok=True)


def fixed_records_file(args, kind: str) -> Path:
    return Path(args.checkpoints) / f"fixed-val-{kind}.jsonl"


def held_out_records(args, cfg: dict, state: dict, chunk: int) -> str:
    """The records of ``chunk``'s held-out conversations (training's validation split: no head trains on these
    conversations, though the first turn of one may reach training with the other kind of answer, the target's or
    ShareGPT's), as JSONL: found by tokenizing the chunk's records as build_features did and matching the stored ids."""
    from transformers import AutoTokenizer

    from griffin.chat_template import tokenize_conversation
    from griffin.target import resolve_target_path

    from ..data import BadConversation, to_messages
    from ..store import FeatureStore
    from ..train import VAL_FRACTION, split

    answered = chunk_records(state, cfg, chunk)
    store = FeatureStore(build_chunk(args, cfg, chunk, {}, answered))
    wanted = {tuple(store[i].input_ids.tolist()): i for i in split(len(store), VAL_FRACTION)[1]}
    kind, shards = chunk_source(cfg, chunk)
    if kind == "regen":
        records = iter_records(regenerated(args, cfg, chunk, shards, answered))
    else:
        first = shards.start * cfg["shard_records"]
        records = itertools.islice(iter_records(cfg["data"]), first, shards.stop * cfg["shard_records"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(cfg["target"]))
    tokenizer.chat_template = store.manifest.get("chat_template") or tokenizer.chat_template  # as built
    lines = []
    for record in records:
        try:
            ids, _ = tokenize_conversation(tokenizer, to_messages(record), cfg["max_len"])
        except BadConversation:
            continue
        if wanted.pop(tuple(ids.tolist()), None) is not None:
            lines.append(json.dumps(record) + "\n")
    if wanted:
        raise StoreError(f"{len(wanted)} held-out conversations of chunk {chunk} match no record of it: delete "
                         f"{Path(args.work)} and {args.sharegpt_store} so that the recipe rebuilds them")
    return "".join(lines)


def fixed_val_stores(args, cfg: dict, state: dict, upto: int) -> dict[str, Path]:
    """Features of the fixed validation sets of chunks up to ``upto`` (rebuilt from their committed records where
    lost; a set is first taken when the recipe reaches its chunk, so that nothing is built ahead of the schedule)."""
    stores = {}
    for kind, chunk in fixed_sets(cfg).items():
        records = fixed_records_file(args, kind)
        if chunk > upto and not records.is_file():
            continue
        if not records.is_file():
            atomic_write_text(records, held_out_records(args, cfg, state, chunk))
        stores[kind] = Path(args.work) / f"fixed-val-{kind}"
        if not (stores[kind] / MANIFEST).is_file():
            scheduler.python("training.build_features", "--data", str(records), "--out", str(stores[kind]),
                             "--target", cfg["target"], "--max-len", str(cfg["max_len"]), "--dtype", args.dtype,
                             *layers(cfg))
    return stores


def fixed_val(args, run: Path, head: Head, steps: int, stores: dict[str, Path]) -> dict[str, list[dict]]:
    """Per fixed set, per pass top-1 and kept of the head in ``run`` (scored once, kept in the run folder)."""
    scores = {}
    for kind, store in stores.items():
        report = run / f"fixed-val-{kind}.json"
        if not report.is_file():
            scheduler.python("training.evaluate", str(run), "--features", str(store), "--steps", str(steps),
                             "--topk", str(head.topk), "--mixed-precision", autocast(args), "--out", str(report))
        scores[kind] = [{k: p[k] for k in ("pass", "top1", "kept")} for p in json.loads(report.read_text())["passes"]]
    return scores


def longest_first(state: dict, cfg: dict, chunk: int, heads: list[Head]) -> list[Head]:
    """``heads`` by the seconds each trained on the last chunk of ``chunk``'s kind, longest first (a head without such
    a time first of all): the order their trainings start in with --jobs 2 or more, so that a chunk does not wait at
    its end for a long training that started last."""
    kind = chunk_source(cfg, chunk)[0]
    rows = [r for r in state["timings"] if r["kind"] == kind and r["chunk"] < chunk]

    def seconds(head: Head) -> float:
        return next((r["train_s"][head.name] for r in reversed(rows) if head.name in r["train_s"]), math.inf)

    return sorted(heads, key=seconds, reverse=True)


def train_seconds(run: Path) -> int:
    """Seconds the run spent in its updates (its validation report; summed over resumes, without loading and
    validation)."""
    return round(json.loads((run / "validation.json").read_text())["epochs"][-1]["train_seconds"])


def backfill_fixed_val(args, state: dict, stores: dict[str, Path]) -> None:
    """Score the curve's earlier points on the fixed sets where their runs are still on this machine."""
    heads = {h.name: h for h in all_heads(state["settings"])}
    for point in state["curve"]:
        run = run_folder(args, point["head"], point["chunk"])
        missing = {kind: store for kind, store in stores.items() if kind not in point.get("fixed", {})}
        if missing and (run / "model.safetensors").is_file():
            scores = fixed_val(args, run, heads[point["head"]], point["steps"], missing)
            point["fixed"] = point.get("fixed", {}) | scores


def train(args, cfg: dict, state: dict, head: Head, chunk: int, store: Path) -> Path:
    """Train ``head`` on one chunk, from its head after the previous chunk (local run, else the committed head)."""
    stage = stage_of(cfg, chunk)
    run = run_folder(args, head.name, chunk)
    if (run / "validation.json").is_file() and (run / "model.safetensors").is_file():
        return run
    init = None
    if chunk > 0:
        source = head.name if head.name in state["heads"] else head.parent
        local = run_folder(args, source, chunk - 1)
        init = local if (local / "model.safetensors").is_file() and (local / "validation.json").is_file() else \
            head_folder(args, source)
    if init is not None:
        init = widened(cfg, run, init)
    lr = peak_lr(cfg, chunk)
    passes = ["--ttt-steps", str(head.ttt)] if head.ttt else ["--steps", str(head.steps[stage - 1])]
    argv = ["--features", str(store), "--out", str(run), "--arch", head.arch, *passes,
            "--topk", str(training_topk(head, chunk)), "--lr", f"{lr:.3g}", "--epochs", "1",
            "--batch-size", str(cfg["batch_size"]), "--draft-vocab", str(cfg["draft_vocab"]),
            "--mixed-precision", autocast(args), "--save-every", "50"]
    if init is not None:
        argv += ["--init-from", str(init)]

    def resumed() -> list[str]:  # continues the checkpoint a killed earlier run left (else train refuses its --out)
        return argv + ["--resume"] if (run / "train_state").is_dir() else argv

    scheduler.python("training.train", *resumed(), again=resumed)
    return run


def widened(cfg: dict, run: Path, init: Path) -> Path:
    """``init``, or its copy widened to the recipe's draft vocabulary beside ``run`` where a rerun raised it."""
    size = json.loads((init / "config.json").read_text()).get("draft_vocab_size") or 0
    if size == cfg["draft_vocab"]:
        return init
    wide = run.with_name(f"{run.name}-init-{cfg['draft_vocab']}")
    if not (wide / "config.json").is_file():  # written after the weights
        scheduler.python("training.vocab", str(init), "--size", str(cfg["draft_vocab"]), "--out", str(wide),
                         "--target", cfg["target"], "--data", cfg["data"])
    return wide


def train_and_score(args, cfg: dict, state: dict, head: Head, chunk: int, store: Path,
                    fixed_stores: dict[str, Path]) -> tuple[Path, dict[str, list[dict]]]:
    """-> (the run of ``head`` on ``chunk``, its scores on the fixed sets): the part of a chunk that needs no
    bookkeeping, so that heads can do it side by side."""
    run = train(args, cfg, state, head, chunk, store)
    return run, fixed_val(args, run, head, head.steps[stage_of(cfg, chunk) - 1], fixed_stores)


def head_folder(args, name: str) -> Path:
    """The exported head ``name``: ``wip-<name>`` so that its card lists only speed runs of this head."""
    return Path(args.checkpoints) / f"wip-{name}"


def export(args, state: dict, head: Head, chunk: int, run: Path, fixed: dict[str, list[dict]]) -> None:
    """The head after ``chunk`` -> --checkpoints/wip-<head> (fp16, card); its record in recipe.json."""
    dst = head_folder(args, head.name)
    history = state["heads"].get(head.name) or {"chunks": list(state["heads"][head.parent]["chunks"]) if head.parent
                                                else [], "forked_from": head.parent}
    previous = head_folder(args, head.name if head.name in state["heads"] else (head.parent or head.name))
    stages = json.loads((previous / "stages.json").read_text()) if (previous / "stages.json").is_file() else []
    report = json.loads((run / "validation.json").read_text())
    atomic_write_json(run / "stages.json", stages + [report])
    scheduler.python("training.export", str(run), str(dst), "--name", head.label, "--notes",
                     f"Trained by training.recipe chunk by chunk (this head: {len(history['chunks']) + 1} chunks so "
                     "far); one row per chunk above.")
    history["chunks"] = history["chunks"] + [chunk]
    state["heads"][head.name] = history
    last = report["epochs"][-1]
    seen = sum(s["epochs"][-1]["tokens"] for s in stages + [report])
    state["curve"].append({"head": head.name, "chunk": chunk, "steps": report["run"]["steps"], "tokens_seen": seen,
                           "lr": report["run"]["lr"],
                           "passes": [{k: p[k] for k in ("pass", "top1", "kept")} for p in last["passes"]],
                           "fixed": fixed})
