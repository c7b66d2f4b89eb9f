"""Resumable training state shared by the trainers: accelerate's state folder plus a ``progress.json``, swapped in
atomically so that a run killed at any moment leaves either the previous state or the new one, never half of one."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from accelerate import Accelerator

from griffin.io import atomic_write_json

log = logging.getLogger(__name__)


def save_state(acc: Accelerator, out: Path, name: str, progress: dict) -> None:
    """Model, optimiser, scheduler and RNG states -> ``out/name`` with ``progress`` as its ``progress.json``."""
    tmp, state, old = out / f".{name}.tmp", out / name, out / f".{name}.old"
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    acc.wait_for_everyone()
    acc.save_state(str(tmp))
    acc.wait_for_everyone()
    if acc.is_main_process:
        atomic_write_json(tmp / "progress.json", progress)
        if state.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(state, old)
        os.replace(tmp, state)
        shutil.rmtree(old, ignore_errors=True)


def saved_folder(out: Path, name: str) -> Path | None:
    """The folder :func:`save_state` left in ``out``, or None when there is none."""
    state = out / name
    if not state.is_dir() and (out / f".{name}.old").is_dir():
        state = out / f".{name}.old"  # killed between the two renames of save_state
    return state if state.is_dir() else None


def saved_progress(out: Path, name: str) -> dict | None:
    """The ``progress`` of the state saved in ``out``, read without restoring anything (to check a resume's settings
    before its weights meet a model of another shape), or None when there is none."""
    state = saved_folder(out, name)
    return None if state is None else json.loads((state / "progress.json").read_text())


def load_state(acc: Accelerator, out: Path, name: str) -> dict | None:
    """Restore the states saved by :func:`save_state`; -> their ``progress``, or None when there are none."""
    state = saved_folder(out, name)
    if state is None:
        log.info("no saved state in %s: starting from scratch", out)
        return None
    acc.load_state(str(state))
    return json.loads((state / "progress.json").read_text())
