"""Atomic file writes: write to a temporary file in the same folder, flush, then rename over the destination."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def atomic_path(dest: str | os.PathLike):
    """Yield a temporary path beside ``dest``; on success it is fsynced and renamed to ``dest``, else removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
    try:
        yield Path(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write(dest: str | os.PathLike, writer: Callable[[Path], Any]) -> None:
    with atomic_path(dest) as tmp:
        writer(tmp)


def atomic_write_text(dest: str | os.PathLike, text: str) -> None:
    atomic_write(dest, lambda p: p.write_text(text))


def atomic_write_json(dest: str | os.PathLike, data: Any) -> None:
    atomic_write_text(dest, json.dumps(data, indent=2, default=str) + "\n")
