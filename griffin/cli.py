"""Shared command-line plumbing: logging set-up, argument types that refuse bad values, output folders that are checked
before work starts, and turning expected errors into one clear line (no traceback).

Light on purpose (no torch): every command parses its arguments, so ``--help`` and usage errors return at once.
"""

from __future__ import annotations

import argparse
import errno
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_cli(main: Callable[[list[str] | None], int], expected: tuple[type[BaseException], ...] = (),
            argv: list[str] | None = None, interrupted: str = "interrupted: rerun the same command to resume") -> int:
    """Run ``main(argv)`` (None: the command line); errors caused by the user's input or the machine (a missing or
    unreadable file, a full disk) print ``error: ...`` on one line and exit 2 (GRIFFIN_DEBUG=1 re-raises)."""
    logging.basicConfig(level=os.environ.get("GRIFFIN_LOG", "INFO"), format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    quiet_hub_bars(sys.stderr)
    try:
        return main(argv)
    except (ValueError, OSError, *expected) as err:
        if os.environ.get("GRIFFIN_DEBUG"):
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130


def quiet_hub_bars(stream) -> None:
    """Where ``stream`` is not a terminal (a log file, CI), turn off the Hugging Face libraries' own bars ("Loading
    weights", downloads): there a bar writes every redraw into one ever longer line, and the commands' own progress
    lines already say what is under way. ``HF_HUB_DISABLE_PROGRESS_BARS=0`` keeps them."""
    if hasattr(stream, "isatty") and stream.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when the libraries are imported
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "1":
        return
    if "transformers" in sys.modules:  # imported already: its switch also turns off the hub's
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if isinstance(err, ValueError) or not text else f"{text} ({type(err).__name__})"


# --- argument types ------------------------------------------------------------------------------------------------


def _number(kind: type, test: Callable[[float], bool], wanted: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}") from None
        if not (math.isfinite(value) and test(value)):
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text!r}")
        return value

    parse.__name__ = wanted  # argparse names the type in some messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "an integer >= 1")
nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _number(float, lambda v: v > 0, "a number > 0")
nonnegative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
probability = _number(float, lambda v: 0 < v <= 1, "a number in (0, 1]")
fraction = _number(float, lambda v: 0 < v < 1, "a number in (0, 1)")


def add_tree_arguments(p: argparse.ArgumentParser, total_tokens: str | int | None = "auto") -> None:
    """``--total-tokens`` (a fixed tree size, skipping the tuning), ``--retune`` and ``--lookup`` for every generating
    command."""
    p.add_argument("--total-tokens", type=tree_size, default=total_tokens,
                   help="draft tree size: an integer fixes it and skips the tuning (0: no tree, so plain decoding, or "
                        "prompt lookup alone with --lookup); 'auto' (default) uses the size tuned for this machine "
                        "and head (measured once, in under a minute)")
    p.add_argument("--retune", action="store_true", help="measure the best tree size again (with 'auto')")
    p.add_argument("--lookup", type=nonnegative_int, default=0,
                   help="add to each draft tree a chain of this many tokens copied from the context (prompt lookup; "
                        "0, the default: none); an auto tree size is tuned with the chain")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` of the target for the commands a user generates with (demo, chat)."""
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="target dtype (default: fp32 on CPU, bf16 on CUDA)")


def tree_size(text: str) -> str | int:
    return "auto" if text == "auto" else _number(int, lambda v: v >= 0, "'auto' or an integer >= 0")(text)


# --- output folders ------------------------------------------------------------------------------------------------


def prepare_out(path: str | os.PathLike, flag: str = "--out", refuse: dict[str, str] | None = None) -> Path:
    """Create the output folder if needed and make sure it can be written, before any work is done. ``refuse``: names
    (glob patterns) of files that another command's output holds -> what that output is; a folder holding one is
    refused, naming it, instead of getting this command's files beside it."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {out} is a file, not a folder: pass a folder path")
    for pattern, what in (refuse or {}).items():
        found = next(out.glob(pattern), None) if out.is_dir() else None
        if found is not None:
            raise ValueError(f"{flag} {out} holds {what} ({found.name}): pass another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        reason = "a parent is a file" if err.errno in (errno.ENOTDIR, errno.EEXIST) else err.strerror or str(err)
        raise ValueError(f"{flag} {out} is not writable ({reason}): pass another folder") from None
    return out

