"""Running the recipe's steps as processes: --jobs slots, the present chunk's steps before data built ahead,
a step killed for memory run again by itself, and stopping them all on an error, Ctrl-C or kill."""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

log = logging.getLogger("recipe")

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
    "jobs": 1,  # --jobs: every process, which a step running alone holds
    "alone": 0,  # steps waiting to run alone (``alone``): no other step takes a process meanwhile
}
SHORT_STEPS = {"training.evaluate", "training.export"}  # a minute or less: a head's scores and export come first
TURNS = itertools.count()  # the order in which the present chunk's steps were submitted (present_steps)
AHEAD = threading.local()  # .chunk: the chunk it builds ahead, if any; .announced, .turn: its step waits, in that turn


def may_take(chunk: int | None, short: bool = False, turn: int | None = None) -> bool:
    """Under SLOTS: whether a step of ``chunk`` built ahead (None: a step of the present chunk; ``short``: one of
    SHORT_STEPS; ``turn``: its place in the order the present steps were submitted) may take a process."""
    if FREE["slots"] < 1 or FREE["alone"]:
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


class StepKilled(RuntimeError):
    """A step's process ended by SIGKILL: on a machine of the recipe's size, the kernel's out-of-memory killer."""


@contextmanager
def alone():
    """Every one of the --jobs processes, so that a step runs by itself: no other step starts while it waits, and it
    starts once the running ones have ended."""
    with SLOTS:
        FREE["alone"] += 1
        try:
            SLOTS.wait_for(lambda: STOPPING.is_set() or FREE["slots"] == FREE["jobs"])
        finally:
            FREE["alone"] -= 1
        taken = FREE["slots"]
        FREE["slots"] = 0
    try:
        yield
    finally:
        with SLOTS:
            FREE["slots"] += taken
            SLOTS.notify_all()


def python(module: str, *argv: str, again: Callable[[], list[str]] | None = None) -> float:
    """Run ``python -m module argv`` as its own process (its output goes to this log) once a slot is free, or fail;
    -> the seconds the process ran (not those it waited for a slot). A process killed by SIGKILL (the out-of-memory
    killer: steps side by side can need more memory than the machine has) runs once more, alone, with the arguments
    ``again()`` gives then (default: the same); steps resume what they had finished (shards, parts, and with
    ``--resume`` from ``again``, the training checkpoint the killed run left)."""
    try:
        with slot(short=module in SHORT_STEPS):
            return run_step(module, *argv)
    except StepKilled as killed:
        log.warning("%s: running it again alone, once the other steps have ended", killed)
        with alone():
            return run_step(module, *(argv if again is None else again()))


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
    if code == -signal.SIGKILL:
        raise StepKilled(f"python -m {module} was killed (SIGKILL; out of memory?)")
    if code != 0:
        raise RuntimeError(f"python -m {module} failed with exit code {code}")
    return time.time() - t0


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
