"""File input and output: atomic writes (a temporary file in the same folder, flushed, then renamed over the
destination), journals of long runs, safetensors reads, and the digest that names a saved model's weights."""

from __future__ import annotations

import hashlib
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


def read_journal(path: str | os.PathLike, settings: Any) -> tuple[list[Any], bool]:
    """The records of a JSON-lines journal whose first line is ``settings`` -> (records, clean).

    A missing file, one written with other settings, or one whose first line was cut gives no records. Reading stops
    at a line cut by a kill. ``clean`` is False when the file holds more than the header and the records returned, or
    lacks its final newline: rewrite it (header + records) before appending to it."""
    path = Path(path)
    if not path.is_file():
        return [], True
    text = path.read_text()
    lines = text.splitlines()
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if header != settings:
        return [], False
    records = []
    for line in lines[1:]:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records, len(records) == len(lines) - 1 and text.endswith("\n")


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Parse a JSON file; invalid JSON raises ValueError naming the file and the place."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}): fix or "
                         f"replace this {what}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file: fix or replace this {what}") from None


def open_safetensors(path: str | os.PathLike):
    """``safe_open`` a safetensors file; a truncated or corrupted file raises ValueError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise ValueError(f"{path} is truncated or corrupted ({err})") from None


def load_safetensors(path: str | os.PathLike) -> dict:
    """Every tensor of a safetensors file (see :func:`open_safetensors` for the errors)."""
    with open_safetensors(path) as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def weights_digest(folder: str | os.PathLike) -> str:
    """A hash of a saved model's ``config.json`` and weights file (16 hex digits): results record it, so that a head
    retrained into the same folder does not inherit the old head's results, while a rewritten card keeps them."""
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors", "pytorch_model.bin"):  # the last: official heads
        path = Path(folder) / name
        if name == "config.json" or path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
