"""File input and output: atomic writes (a temporary file in the same folder, flushed, then renamed over the
destination), journals of long runs, records cached on this machine, safetensors reads, and the digest that names a
saved model's weights."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)
Checked = TypeVar("Checked")


@contextmanager
def atomic_path(dest: str | os.PathLike):
    """Yield a temporary path beside ``dest``; on success it is fsynced and renamed to ``dest``, else removed."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        yield Path(tmp)
        # mkstemp creates 0600, and a writer may replace the file with one of its own (safetensors' save_file
        # does), so the usual permissions are given to whatever file is there now
        os.chmod(tmp, 0o666 & ~umask)
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


def read_cached(path: str | os.PathLike, what: str, check: Callable[[dict], Checked], redo: str) -> Checked | None:
    """A record cached on this machine (kernel choice, tuned tree), as ``check`` returns it; None when there is none.

    ``check`` raises ValueError (or KeyError / TypeError) naming the field when a record parses but is wrong (a
    kernel name this build does not offer, a tree of depth 0). Such a record, like one that is not JSON, is warned
    about, naming the file, and None is returned, so that the caller measures again (``redo``: what it then does)
    and overwrites it."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
        return check(record)
    except (ValueError, KeyError, TypeError, OSError) as err:
        if isinstance(err, (json.JSONDecodeError, UnicodeDecodeError)):
            detail = "not valid JSON"
        elif isinstance(err, KeyError):
            detail = f"no {err.args[0]!r} field"
        else:
            detail = err.strerror if isinstance(err, OSError) else str(err)
        log.warning("%s is damaged (%s: %s): %s", path, what, detail, redo)
        return None


def write_cached(path: str | os.PathLike, record: dict, what: str) -> bool:
    """Cache ``record`` at ``path``; where the cache cannot be written (read-only, a file where a folder should be)
    warn, naming it, and go on: the caller's result then holds for this process only. -> whether it was written."""
    try:
        atomic_write_json(path, record)
        return True
    except OSError as err:
        log.warning("cannot write the %s to %s (%s): it holds for this process only; set GRIFFIN_CACHE to a writable "
                    "folder to keep it", what, path, err.strerror or err)
        return False


def check_integer(record: dict, name: str, least: int, most: int | None = None) -> int:
    """``record[name]``, an integer in [least, most] (ValueError naming the field otherwise)."""
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (most is not None and value > most):
        bounds = f">= {least}" if most is None else f"in [{least}, {most}]"
        raise ValueError(f"{name} is {value!r}, not an integer {bounds}")
    return value


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
