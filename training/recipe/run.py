"""The recipe's loop: chunk after chunk, every head due on it trains, is scored and exported; data is built ahead."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from ..store import MANIFEST, StoreError
from . import publish, scheduler, steps
from .cli import parse_args
from .progress import DATA_COSTS, STATE, chunk_timing, chunks_done, count_records, load_state, plan_text, save_state
from .schedule import Head, all_heads, chunk_source, heads_of, settings, stage_of
from .scheduler import AHEAD, SLOTS, STOPPING, present_steps, stop_on_signals, stop_steps
from .steps import (
    answered_cost,
    answers_file,
    backfill_fixed_val,
    export,
    fixed_val_stores,
    keep_parts,
    longest_first,
    resolve_precision,
    run_folder,
    train_and_score,
    train_seconds,
)

log = logging.getLogger("recipe")

LOCK = ".recipe.lock"  # in --work: one recipe at a time
INPUT_ERRORS = (StoreError, RuntimeError)  # reported as one line, exit 2 (RuntimeError: a step's process failed)


def chunks_ahead(args, cfg: dict, state: dict, chunk: int, todo: list[Head], stop: int) -> list[int]:
    """The next ``--ahead`` chunks after ``chunk`` that a head will train on in this run (``next_chunk``, then the
    chunks after it while the heads this run trains have some due on them)."""
    following, chunks = next_chunk(args, cfg, state, chunk, todo, stop), []
    while following is not None and len(chunks) < args.ahead:
        chunks.append(following)
        following += 1
        due = following < stop and (not args.heads or any(h.name in args.heads
                                                           for h in heads_of(cfg, stage_of(cfg, following))))
        following = following if due else None
    return chunks


def next_chunk(args, cfg: dict, state: dict, chunk: int, todo: list[Head], stop: int) -> int | None:
    """The chunk after ``chunk`` if a head will train on it in this run once the heads ``todo`` have trained on
    ``chunk`` (what ``--jobs`` 2 or more builds ahead)."""
    following = chunk + 1
    if following >= stop:
        return None
    training = {h.name for h in todo}

    def done_after(h: Head) -> int:  # chunks consumed once this chunk is trained (a fork counts its parent's)
        moves = h.name in training or (h.name not in state["heads"] and h.parent in training)
        return chunks_done(state, h) + moves

    wanted = [h for h in heads_of(cfg, stage_of(cfg, following)) if done_after(h) == following
              and (not args.heads or h.name in args.heads)]
    return following if wanted else None


def submit_build(args, cfg: dict, state: dict, pool: ThreadPoolExecutor, ahead: dict[int, tuple[Future, dict]],
                 chunk: int, present: int) -> None:
    """Build ``chunk``'s data in the pool -> ``ahead[chunk]`` (its build, and a copy of its row's data costs, which
    the thread updates and ``collect_ahead`` puts back into the row of timings). It starts after the builds of its kind
    submitted before it (one at a time writes into the shared ShareGPT store), and if one of those is the ``present``
    chunk's, once its training is submitted (``present_steps``): the process its data frees is the present heads'.
    Unless it is the present chunk's, its steps wait while a step of the present waits for a process."""
    row = chunk_timing(state, cfg, chunk)
    costs = {key: row[key] for key in DATA_COSTS if key in row}  # the build updates this copy as it would the row
    records = steps.chunk_records(state, cfg, chunk)
    kind = chunk_source(cfg, chunk)[0]
    before = {c: future for c, (future, _) in ahead.items() if chunk_source(cfg, c)[0] == kind}
    gate = present if present in before else -1

    def build() -> Path:
        for future in before.values():
            future.result()
        with SLOTS:
            SLOTS.wait_for(lambda: STOPPING.is_set() or scheduler.FREE["submitted"] >= gate)
        AHEAD.chunk = chunk if chunk != present else None
        try:
            return steps.build_chunk(args, cfg, chunk, costs, records)
        finally:
            AHEAD.chunk = None

    ahead[chunk] = (pool.submit(build), costs)


def collect_ahead(args, state: dict, cfg: dict, ahead: dict[int, tuple[Future, dict]]) -> None:
    """Put the costs of a data build that ran ahead into its chunk's row as soon as it is done (so that they are saved
    even if the run stops before that chunk starts), with this run's precision and threads where the build changed
    them. The build updated a copy of the row's costs as the row itself is updated (``add_seconds``: a resumed step's
    seconds added, those of a step that started afresh in place of a lost machine's)."""
    for chunk, (future, costs) in ahead.items():
        if future.done() and costs:
            timing = chunk_timing(state, cfg, chunk)
            if any(timing.get(key) != value for key, value in costs.items()):
                timing.update(costs, precision=args.dtype, data_threads=args.threads)
            costs.clear()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(args.work)
    if args.plan:
        return run(args, work)
    from griffin.target import file_lock  # imports torch: not before --help

    with ExitStack() as stack:
        try:
            stack.enter_context(file_lock(work / LOCK, wait=False))
        except BlockingIOError:
            raise RuntimeError(f"another recipe is running with --work {work}: wait for it, or stop it (kill its PID; "
                              "its steps end with it) and rerun") from None
        stack.enter_context(stop_on_signals())
        return run(args, work)


def run(args: argparse.Namespace, work: Path) -> int:
    STOPPING.clear()  # a run in this process after a stopped one
    scheduler.FREE.update(slots=args.jobs, ahead=args.jobs - 1, waiting=0, short=0, turns=[], queued=[], submitted=-1,
                          jobs=args.jobs, alone=0)
    args.dtype = resolve_precision(args.precision)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)  # for every step's process
    work.mkdir(parents=True, exist_ok=True)
    cfg = settings(args, count_records(work, args.data))
    path = Path(args.checkpoints) / STATE
    if args.commit and publish.ignored(args.checkpoints):
        raise ValueError(f"--commit commits --checkpoints, but git ignores {args.checkpoints}: give --checkpoints a "
                         "tracked folder on a work branch (docs/training.md), or run without --commit")
    if not path.is_file() and not args.plan:
        publish.start_from_shipped(args, cfg, path)
    state = load_state(path if path.is_file() else publish.usable_record(args, cfg) or path, cfg)
    print(plan_text(cfg, state))
    if args.plan:
        return 0
    if args.promote:
        return publish.promote(args, cfg, state)
    log.info("precision of every step: %s (--precision %s)", args.dtype, args.precision)
    backfill_fixed_val(args, state, fixed_val_stores(args, cfg, state,
                                                     max((p["chunk"] for p in state["curve"]), default=-1)))
    for point in state["curve"]:  # training seconds from the runs' reports where they are on this machine
        run = run_folder(args, point["head"], point["chunk"])
        if (run / "validation.json").is_file():
            chunk_timing(state, cfg, point["chunk"])["train_s"][point["head"]] = train_seconds(run)
    save_state(path, cfg, state)
    last_commit = 0.0  # the first head this run exports is committed at once, later ones at most every --commit-every
    stop = cfg["chunks"] if args.chunks is None else min(cfg["chunks"], args.chunks)
    # threads wait for slots, then for one step each
    with ThreadPoolExecutor(len(all_heads(cfg)) + args.ahead + 1) as pool:
        ahead: dict[int, tuple[Future, dict]] = {}
        try:
            for chunk in range(stop):
                last_commit = run_chunk(args, cfg, state, path, chunk, stop, pool, ahead, last_commit)
        except BaseException:
            stop_steps(pool)
            # what the run finished survives the machine: heads exported since the last commit, the seconds of
            # builds done ahead, finished regeneration parts
            if args.commit:
                collect_ahead(args, state, cfg, ahead)
                save_state(path, cfg, state)
                keep_parts(args, cfg, state)
                publish.commit(args, "what a stopped run had finished")
            raise
        if any(not future.done() for future, _ in ahead.values()):  # built for heads this run does not train
            stop_steps(pool)
    print(plan_text(cfg, state))
    return 0


def run_chunk(args, cfg: dict, state: dict, path: Path, chunk: int, stop: int, pool: ThreadPoolExecutor,
              ahead: dict[int, tuple[Future, dict]], last_commit: float) -> float:
    """Every head due on ``chunk`` trains on it, is scored, exported and (with --commit) committed; -> the time of the
    last commit. With --jobs 2 or more, the data of the next --ahead chunks is built meanwhile (``ahead``: chunk -> its
    build and seconds) and the heads train side by side; they are exported in order."""
    stage = stage_of(cfg, chunk)
    todo = [h for h in heads_of(cfg, stage)
            if chunks_done(state, h) == chunk and (not args.heads or h.name in args.heads)]
    if not todo:
        with SLOTS:  # builds ahead that wait for this chunk's training go on
            scheduler.FREE["submitted"] = max(scheduler.FREE["submitted"], chunk)
            SLOTS.notify_all()
        return last_commit
    timing = chunk_timing(state, cfg, chunk)
    timing.update(precision=args.dtype, data_threads=args.threads)  # of the run that reached the chunk
    if args.jobs > 1:  # this chunk's data (unless built ahead already), then the next chunks' beside it
        for c in [chunk] + chunks_ahead(args, cfg, state, chunk, todo, stop):
            if c not in ahead:
                submit_build(args, cfg, state, pool, ahead, c, present=chunk)
                if c != chunk:
                    log.info("building chunk %d's data ahead, while chunk %d is built and trained on", c, chunk)
    if chunk in ahead:
        store = ahead[chunk][0].result()
        collect_ahead(args, state, cfg, ahead)  # its seconds, if not added yet
        del ahead[chunk]
    else:
        store = steps.build_chunk(args, cfg, chunk, timing, steps.chunk_records(state, cfg, chunk))
    manifest = json.loads((store / MANIFEST).read_text())
    timing["tokens"], timing["conversations"] = manifest["num_tokens"], manifest["num_samples"]
    kind, shards = chunk_source(cfg, chunk)
    records = steps.chunk_records(state, cfg, chunk)
    answered = answered_cost(args, cfg, shards, records) if kind == "regen" else None
    if answered is not None:  # the total, not a sum of what each run reported: runs that stopped count once
        timing.update(answered)
    fixed_stores = fixed_val_stores(args, cfg, state, chunk)
    backfill_fixed_val(args, state, fixed_stores)
    save_state(path, cfg, state)
    trainings = present_steps(pool, chunk, {h.name: (train_and_score, args, cfg, state, h, chunk, store, fixed_stores)
                                            for h in longest_first(state, cfg, chunk, todo)}) if args.jobs > 1 else {}
    for head in todo:
        run, fixed = trainings[head.name].result() if trainings else train_and_score(args, cfg, state, head, chunk,
                                                                                     store, fixed_stores)
        timing["train_s"][head.name] = train_seconds(run)
        timing.setdefault("train_threads", {})[head.name] = args.threads  # of the run that finished the training
        export(args, state, head, chunk, run, fixed)
        last = head is todo[-1]
        if all(chunks_done(state, h) > chunk for h in heads_of(cfg, stage)):  # no head will read its answers again
            answers_file(args, chunk).unlink(missing_ok=True)
            steps.prune_features(args, cfg, chunk)
        collect_ahead(args, state, cfg, ahead)
        save_state(path, cfg, state)
        stage_end = last and chunk + 1 in (cfg["stage_ends"][stage - 1], stop)
        if args.commit and (stage_end or time.time() - last_commit >= args.commit_every):
            keep_parts(args, cfg, state)
            publish.commit(args, f"{head.name} after chunk {chunk} (stage {stage}) of {cfg['chunks']}")
            last_commit = time.time()
    return last_commit
