"""recdepth/core/progress.py: a bar on a terminal, log lines elsewhere, nothing for short work."""

import io
import logging

from recdepth.core.progress import Progress, clock


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_clock_reads_minutes_and_hours():
    assert clock(0) == "0:00" and clock(59.6) == "1:00" and clock(125) == "2:05" and clock(3725) == "1:02:05"


def test_a_terminal_gets_a_bar_redrawn_in_place_with_rate_and_time_left():
    now, out = Clock(), Terminal()
    p = Progress("decoding under kl", 8, stream=out, now=now)
    now.t += 2
    p.update(2)  # within the first 5 s: nothing
    assert out.getvalue() == ""
    now.t += 8  # 10 s for 4 of 8 windows: 0.4 windows/s, 4 left -> 10 s
    p.update(2)
    assert out.getvalue() == "\rdecoding under kl: 50% 4/8 windows, 0.4 windows/s, 0:10 left\033[K"
    now.t += 0.1
    p.update(1)  # redrawn at most every 0.2 s
    assert out.getvalue().count("\r") == 1
    now.t += 9.9  # 20 s for 8
    p.update(3)
    p.close()
    assert out.getvalue().endswith("\rdecoding under kl: 100% 8/8 windows, 0.4 windows/s, 0:00 left\033[K\n")


def test_elsewhere_a_log_line_at_each_step_of_the_work_at_most_one_per_gap(caplog):
    now, out = Clock(), io.StringIO()
    with caplog.at_level(logging.INFO, logger="recdepth.core.progress"):
        p = Progress("decoding 3 settings side by side", 100, unit="rows", stream=out, now=now)
        for _ in range(100):
            now.t += 1  # 1 s a row: lines at 6 %, then every 5 s past each next 5 %
            p.update()
        p.close()
    lines = [r.getMessage() for r in caplog.records]
    assert out.getvalue() == ""  # no bar in a file
    assert lines[0].startswith("decoding 3 settings side by side: 5% 5/100 rows, 1 rows/s, 1:35 left")
    assert len(lines) == 21 and lines[-1] == "decoding 3 settings side by side: 100 rows in 1:40"


def test_short_work_shows_nothing(caplog):
    now, term = Clock(), Terminal()
    with caplog.at_level(logging.INFO, logger="recdepth.core.progress"):
        with Progress("timing fixed at batch 1", 10, stream=term, now=now) as p:
            for _ in range(10):
                now.t += 0.4
                p.update()
        with Progress("timing fixed at batch 1", 10, stream=io.StringIO(), now=now) as p:
            for _ in range(10):
                now.t += 0.4
                p.update()
    assert term.getvalue() == "" and not caplog.records


def test_an_evaluation_reports_its_decoding_and_timed_passes(monkeypatch, caplog):
    """The wiring: `evaluate_exit` (every command's evaluation) shows the batched pass in
    windows and the timed batch-1 pass, here with no quiet time and no gap."""
    import functools

    import torch

    from recdepth import exits
    from recdepth.decode import scoring
    from recdepth.decode.settings import DecodeSettings
    from tests.decode.helpers import model

    monkeypatch.setattr(scoring, "Progress", functools.partial(Progress, quiet=0, gap=0, stream=io.StringIO()))
    m = model([[1], [2, 3]])
    tokens = torch.randint(0, 60, (60,), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="recdepth.core.progress"):
        scoring.evaluate_exit(m, tokens, exits.build("fixed", None, max_steps=2), 44,
                              DecodeSettings(batch_size=2, latency_tokens=11, repeats=1))
    lines = [r.getMessage() for r in caplog.records]
    assert any(x.startswith("decoding under fixed: 100% 4/4 windows") for x in lines), lines  # 44 = 4 x 11
    assert any(x.startswith("timing fixed at batch 1: 100% 1/1 windows") for x in lines), lines
