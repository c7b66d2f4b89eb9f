"""Shared command-line plumbing: logging set-up and turning expected errors into one clear line (no traceback)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable


def run_cli(main: Callable[[list[str] | None], int], expected: tuple[type[BaseException], ...] = (),
            argv: list[str] | None = None) -> int:
    """Run ``main(argv)`` (None: the command line); errors caused by the user's input print ``error: ...`` and exit 2
    (GRIFFIN_DEBUG=1 re-raises)."""
    logging.basicConfig(level=os.environ.get("GRIFFIN_LOG", "INFO"), format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    try:
        return main(argv)
    except (ValueError, FileNotFoundError, *expected) as err:
        if os.environ.get("GRIFFIN_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
