"""Progress of long work (decoding an evaluation's windows, a sweep's settings side by side,
the timed passes): a bar on a terminal, redrawn in place on stderr; elsewhere (a log file, a
CI job, a SLURM job) a log line at every `step` of the work (5%), at most one per `gap`
seconds. Work that ends within `quiet` seconds shows nothing either way.

    with Progress("decoding 25 settings side by side", total=len(rows), unit="rows") as p:
        for batch in batches:
            ...
            p.update(len(batch))

Core: the standard library only.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger(__name__)


def clock(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Progress:
    """`what` done `total` `unit`s at a time. `stream`: where a terminal's bar goes (stderr);
    a stream that is not a terminal gets log lines instead. `now`: the clock (tests pass
    their own)."""

    def __init__(self, what: str, total: int, unit: str = "windows", step: float = 0.05, gap: float = 5.0,
                 quiet: float = 5.0, stream: TextIO | None = None, now=time.monotonic):
        self.what, self.total, self.unit, self.now = what, max(int(total), 0), unit, now
        self.step, self.gap, self.quiet = step, gap, quiet
        self.logged = 0  # the steps of the work logged so far
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self.start = 0, now()
        self.last = self.start  # the last bar drawn or line logged
        self.drawn = False

    def line(self) -> str:
        """`what`: 37% 120/320 windows, 4.1 windows/s, 0:49 left (after the first update)."""
        elapsed = self.now() - self.start
        pct = 100 * self.done / self.total if self.total else 100.0
        text = f"{self.what}: {pct:.0f}% {self.done}/{self.total} {self.unit}"
        if self.done and elapsed > 0:
            rate = self.done / elapsed
            text += f", {rate:.3g} {self.unit}/s, {clock((self.total - self.done) / rate)} left"
        return text

    def update(self, n: int = 1) -> None:
        self.done = min(self.done + n, self.total)
        t = self.now()
        if t - self.start < self.quiet:
            return
        if self.tty and (t - self.last >= 0.2 or not self.drawn):
            self.stream.write("\r" + self.line() + "\033[K")
            self.stream.flush()
            self.last, self.drawn = t, True
        elif not self.tty and self.total and t - self.last >= self.gap:
            at = self.done * round(1 / self.step) // self.total  # integers: 15 % is step 3, not 2.999
            if at > self.logged:
                log.info(self.line())
                self.last, self.logged = t, at

    def close(self) -> None:
        """The last state: the bar finished with a newline, or a log line saying how long it took
        (when anything was shown)."""
        elapsed = self.now() - self.start
        if self.tty and self.drawn:
            self.stream.write("\r" + self.line() + "\033[K\n")
            self.stream.flush()
        elif not self.tty and elapsed >= self.quiet:
            log.info("%s: %d %s in %s", self.what, self.done, self.unit, clock(elapsed))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
