"""Publishing the recipe's heads: shipping the finished heads with the record of their run (--promote), starting a
fresh work folder from them, and committing the work folder as a run goes (--commit)."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

from griffin.io import atomic_write_json, atomic_write_text

from ..store import StoreError
from . import scheduler
from .progress import chunks_done, load_state, progress_markdown, save_state
from .schedule import final_heads, fixed_sets
from .steps import fixed_records_file, head_folder

log = logging.getLogger("recipe")

COMMIT_PREFIX = "recipe: "  # the subject of the recipe's commits
TRAILER = "Recipe-run: training.recipe"  # the last line of their message: what it may amend
LANDED = ("main", "master")  # branches whose commits are submitted as they are: never amended


def shipped_folder(args, name: str) -> Path:
    """Where --promote ships head ``name``: ``--ship/<target>-<name>``, the folder the default head is read from."""
    return Path(args.ship) / f"{Path(args.target).name}-{name}"


def promote(args, cfg: dict, state: dict) -> int:
    """Every stage-2 head that has consumed every chunk -> ``shipped_folder``; the record of the run (recipe.json,
    its tables as progress.md, the fixed validation sets) -> beside ``--record``: a fresh work folder continues from
    there."""
    behind = [f"{h.name} {chunks_done(state, h)}" for h in final_heads(cfg) if chunks_done(state, h) < cfg["chunks"]]
    if behind:
        raise ValueError(f"--promote ships finished heads, but these have consumed fewer than all {cfg['chunks']} "
                         f"chunks: {', '.join(behind)}; run the recipe to the end first (the same command without "
                         "--promote)")
    record = Path(args.record)
    for head in final_heads(cfg):
        dst = shipped_folder(args, head.name)
        seen = next(p["tokens_seen"] for p in reversed(state["curve"]) if p["head"] == head.name)
        scheduler.python("training.export", str(head_folder(args, head.name)), str(dst), "--name", head.label,
                         "--notes", f"Trained by training.recipe on all {cfg['chunks']} chunks ({seen / 1e6:.2f}M "
                         "tokens: every ShareGPT record and the target's own answers to first turns), one row per "
                         f"chunk above; learning curve and the time of every step in {record.parent}/progress.md.")
        log.info("shipped %s -> %s", head_folder(args, head.name), dst)
    atomic_write_text(Path(args.checkpoints) / "README.md", progress_markdown(cfg, state))
    atomic_write_json(record, state)
    atomic_write_text(record.with_name("progress.md"), progress_markdown(cfg, state))
    for kind in fixed_sets(cfg):
        if fixed_records_file(args, kind).is_file():
            atomic_write_text(record.with_name(fixed_records_file(args, kind).name),
                              fixed_records_file(args, kind).read_text())
    log.info("the run's record -> %s", record)
    return 0


def usable_record(args, cfg: dict) -> Path | None:
    """``--record`` where it is a run of the same settings (else None: the recipe starts from nothing)."""
    record = Path(args.record)
    if not record.is_file():
        return None
    try:
        load_state(record, cfg)
    except StoreError as err:
        log.info("not continuing from %s: %s", record, err)
        return None
    return record


def start_from_shipped(args, cfg: dict, path: Path) -> None:
    """A fresh --checkpoints folder continues from the record of the run that trained the shipped heads: every head
    that record still trains from is copied from ``shipped_folder`` (which must be that head after the chunks the
    record says it consumed: its stages.json has one row per chunk), with the fixed validation sets and recipe.json."""
    record = usable_record(args, cfg)
    if record is None:
        return
    state = load_state(record, cfg)
    started = [h for h in final_heads(cfg) if h.name in state["heads"]]
    needed = [h.name for h in started] + sorted({h.parent for h in final_heads(cfg) if h not in started and h.parent})
    for name in needed:
        stages = shipped_folder(args, name) / "stages.json"
        consumed = len(state["heads"].get(name, {}).get("chunks", []))
        if not stages.is_file() or len(json.loads(stages.read_text())) != consumed:
            raise StoreError(f"{record} has {name} after {consumed} chunks, but {shipped_folder(args, name)} is not "
                             "that head: give --record the record of the heads in --ship (a path that does not exist: "
                             "start afresh)")
    for name in needed:
        tmp = head_folder(args, name).with_name(head_folder(args, name).name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(shipped_folder(args, name), tmp)
        tmp.replace(head_folder(args, name))
    for kind in fixed_sets(cfg):
        kept = record.with_name(fixed_records_file(args, kind).name)
        if kept.is_file():
            atomic_write_text(fixed_records_file(args, kind), kept.read_text())
    save_state(path, cfg, state)
    log.info("continuing from %s and the heads in %s (%s)", record, args.ship, ", ".join(needed))


def ignored(folder: str | Path) -> bool:
    """Whether git ignores ``folder`` (so that --commit could not commit it)."""
    return git("check-ignore", "-q", "--", str(folder)).returncode == 0


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
