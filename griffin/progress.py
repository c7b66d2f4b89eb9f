"""Progress bars that suit where the output goes: a live bar on a terminal; in a log file (CI, ``nohup``), where a bar
would write a line per tick, one line when it starts, a status line every ``progress.EVERY`` seconds (done, rate,
time left and the bar's postfix) and one line when it closes. A status line's rate is that since the line before it, so
that a pause (a job stopped with SIGSTOP, a laptop asleep) or a change of pace misleads one line, not the rest of the
run."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from tqdm.auto import tqdm


class progress(tqdm):  # noqa: N801 - used like tqdm
    """``tqdm`` that, when its output is not a terminal, writes a line when it starts, a status line at most every
    ``EVERY`` seconds while it advances, and a line when it closes (with the seconds taken), instead of a line per
    tick. Same arguments as ``tqdm``."""

    EVERY = 300.0  # seconds between two status lines in a log file

    def __init__(self, *args, file: IO[str] | None = None, disable: bool = False, **kwargs):
        out = file or sys.stderr
        self.lines = not disable and not (hasattr(out, "isatty") and out.isatty())
        self.note = ""  # tqdm's init may call set_postfix
        super().__init__(*args, file=out, disable=disable or self.lines, **kwargs)
        self.out, self.started = out, time.perf_counter()
        self.said, self.done, self.first = self.started, float(self.n), float(self.n)  # n: tqdm's initial
        self.said_worked = 0.0  # items this run had worked on at the last status line
        self.label, self.unit_name = kwargs.get("desc") or "progress", kwargs.get("unit", "it")
        if self.lines:
            if self.total is None and hasattr(self.iterable, "__len__"):
                self.total = len(self.iterable)
            size = f" ({self.total:g} {self.unit_name})" if isinstance(self.total, (int, float)) else ""
            print(f"{self.label}: started{size}", file=out, flush=True)

    def __iter__(self) -> Iterator[Any]:
        if not self.lines:
            yield from super().__iter__()
            return
        try:
            for item in self.iterable:  # tqdm's own loop skips update() and close() when disabled
                yield item
                self.update(1)
        finally:
            self.close()

    def update(self, n: float = 1) -> bool | None:
        if self.lines:
            self.done += n
            now = time.perf_counter()
            if now - self.said >= self.EVERY:
                print(self.status(now - self.started, since=now - self.said), file=self.out, flush=True)
                self.said, self.said_worked = now, self.done - self.first
        return super().update(n)

    def skip(self, n: float) -> None:
        """Count ``n`` items this run did not work on (done before a resume, or another process's): they advance the
        bar but not the rate of a status line, whose time left is then that of the work still to do here."""
        if self.lines:
            self.first += n
        self.update(n)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        self.note = ", ".join(f"{k}={v}" for k, v in {**(ordered_dict or {}), **kwargs}.items())
        super().set_postfix(ordered_dict, refresh, **kwargs)

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.note = s
        super().set_postfix_str(s, refresh)

    def status(self, elapsed: float, since: float) -> str:
        """``"train: 120/226 upd after 1800 s (0.0667 upd/s, about 1590 s left; loss=...)"``: the rate of the last
        ``since`` seconds, in items this run worked on (a resumed bar starts at its initial; skipped items don't
        count)."""
        rate = (self.done - self.first - self.said_worked) / max(since, 1e-9)
        done = f"{self.done:g}/{self.total:g}" if self.total else f"{self.done:g}"
        left = f", about {(self.total - self.done) / rate:.0f} s left" if self.total and rate > 0 else ""
        note, unit = f"; {self.note}" if self.note else "", self.unit_name
        return f"{self.label}: {done} {unit} after {elapsed:.0f} s ({rate:.3g} {unit}/s{left}{note})"

    def close(self) -> None:
        if self.lines:
            self.lines = False
            print(f"{self.label}: finished in {time.perf_counter() - self.started:.0f} s", file=self.out, flush=True)
        super().close()
