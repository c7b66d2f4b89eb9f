"""Progress bars that suit where the output goes: a live bar on a terminal, one line at the start and one at the end
in a log file (CI, ``nohup``), where a bar would write a line per tick."""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm.auto import tqdm


class progress(tqdm):  # noqa: N801 - used like tqdm
    """``tqdm`` that, when its output is not a terminal, writes only a line when it starts and one when it closes
    (with the seconds taken) instead of a line per tick. Same arguments as ``tqdm``."""

    def __init__(self, *args, file: IO[str] | None = None, disable: bool = False, **kwargs):
        out = file or sys.stderr
        self.lines = not disable and not (hasattr(out, "isatty") and out.isatty())
        super().__init__(*args, file=out, disable=disable or self.lines, **kwargs)
        self.out, self.started = out, time.perf_counter()
        self.label = kwargs.get("desc") or "progress"
        if self.lines:
            total = kwargs.get("total")
            size = f" ({total:g} {kwargs.get('unit', 'it')})" if isinstance(total, (int, float)) else ""
            print(f"{self.label}: started{size}", file=out, flush=True)

    def close(self) -> None:
        if self.lines:
            self.lines = False
            print(f"{self.label}: finished in {time.perf_counter() - self.started:.0f} s", file=self.out, flush=True)
        super().close()
