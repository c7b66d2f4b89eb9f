"""Publishing the recipe's heads: shipping the finished heads (--promote) and committing the work folder (--commit)."""

from __future__ import annotations

import logging
import subprocess
import time
from pathlib import Path

from griffin.io import atomic_write_text

from . import scheduler
from .progress import chunks_done, progress_markdown
from .schedule import HEADS
from .steps import head_folder

log = logging.getLogger("recipe")


COMMIT_PREFIX = "recipe: "  # the subject of the recipe's commits


TRAILER = "Recipe-run: training.recipe"  # the last line of their message: what it may amend


LANDED = ("main", "master")  # branches whose commits are submitted as they are: never amended


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
        scheduler.python("training.export", str(head_folder(args, head.name)), str(dst), "--name", head.label,
                         "--notes", f"Trained by training.recipe on all {cfg['chunks']} chunks ({seen / 1e6:.2f}M "
                         "tokens: every ShareGPT record and the target's own answers to first turns), one row per "
                         f"chunk above; learning curve and the time of every step in {args.checkpoints}/README.md.")
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
