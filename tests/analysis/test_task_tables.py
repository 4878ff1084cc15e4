"""task_tables.best_fixed: every rule against the best fixed depth of a task's sweep, checked
against numbers computed here by hand and a bootstrap written out here over windows."""

import numpy as np
import pytest

from recdepth.analysis import task_tables
from recdepth.analysis.token_files import write_tokens


def job(tmp, k, exit_, n, correct, apps, window):
    d = tmp / str(k)
    d.mkdir()
    m = len(correct)
    write_tokens(d / "eval_tokens.csv", window, np.arange(m), np.zeros(m), np.zeros(m), np.zeros(m),
                 np.asarray(apps)[:, None], task={"answer": np.ones(m), "difficulty": np.ones(m), "correct": correct})
    acc = float(np.mean(correct))
    return {"exit": exit_, "tau": None, "max_steps": n, "group_layers": [1], "outside_layers": 2,
            "answers": {"accuracy": [acc, acc, acc], "layer_applications": [2 + float(np.mean(apps))]}}


def test_best_fixed_by_hand(tmp_path):
    w = np.repeat(np.arange(4), 3)  # 4 windows of 3 answers
    evs = {0: job(tmp_path, 0, "fixed", 2, [1, 0, 1] * 4, [2] * 12, w),  # 0.667 at 4 layer applications
           1: job(tmp_path, 1, "fixed", 4, [1, 1, 1] * 4, [4] * 12, w),  # 1.000 at 6: the best
           2: job(tmp_path, 2, "fixed", 8, [1, 1, 1] * 4, [8] * 12, w),  # tied, dearer
           3: job(tmp_path, 3, "kl", 32, [1, 1, 0] + [1, 1, 1] * 3, [1, 2, 4] * 4, w)}
    rows, md = task_tables.best_fixed(tmp_path, evs, resamples=500)
    (r,) = rows
    assert r["best_fixed_job"] == 1 and r["best_fixed_n"] == 4
    assert r["accuracy_diff"] == pytest.approx(11 / 12 - 1)
    # cost per answer: 2 + apps = 3, 4, 6 against 6 each: saving 1 - (13 / 3) / 6
    assert r["saving"] == pytest.approx(1 - 13 / 18) and r["layer_applications"] == pytest.approx(13 / 3)
    # every window has the same costs, so every resample's saving is the same: a point interval
    assert r["saving_lo"] == pytest.approx(1 - 13 / 18) and r["saving_hi"] == pytest.approx(1 - 13 / 18)
    # the accuracy interval: resampled windows, one of which loses an answer (a third of its 3)
    assert -1 / 3 <= r["accuracy_diff_lo"] <= r["accuracy_diff"] <= r["accuracy_diff_hi"] <= 0
    assert "n = 4" in md and "| 3 | kl" in md


def test_best_fixed_interval_is_a_bootstrap_over_windows(tmp_path):
    """The saving's interval against a bootstrap written here: windows drawn with replacement,
    the ratio of the drawn answers' total costs."""
    rng = np.random.default_rng(1)
    w = np.repeat(np.arange(30), 4)
    apps = rng.integers(1, 10, 120)
    evs = {0: job(tmp_path, 0, "fixed", 10, [1] * 120, [10] * 120, w),
           1: job(tmp_path, 1, "fixed", 1, [0] * 120, [1] * 120, w),
           2: job(tmp_path, 2, "accel", 32, [1] * 120, apps, w)}
    (r,), _ = task_tables.best_fixed(tmp_path, evs, resamples=4000)
    cost = 2 + apps
    sims = []
    for _ in range(4000):
        pick = rng.integers(0, 30, 30)
        sims.append(1 - sum(cost[w == u].sum() for u in pick) / (12 * 4 * 30))
    lo, hi = np.percentile(sims, [2.5, 97.5])
    assert r["saving"] == pytest.approx(1 - cost.mean() / 12)
    assert r["saving_lo"] == pytest.approx(lo, abs=0.02) and r["saving_hi"] == pytest.approx(hi, abs=0.02)
    assert r["accuracy_diff"] == 0 and r["accuracy_diff_lo"] == 0 == r["accuracy_diff_hi"]


def test_best_fixed_reads_each_jobs_cost_with_its_checks_and_time_per_answer(tmp_path):
    """A job whose eval_tokens.csv has a `cost` column (its checks priced) is compared in it,
    the loop alone beside it; the jobs' ms per answer come from their eval blocks."""
    w = np.repeat(np.arange(2), 2)
    evs = {0: job(tmp_path, 0, "fixed", 4, [1] * 4, [4] * 4, w),  # 6 layer applications per answer
           1: job(tmp_path, 1, "kl", 32, [1] * 4, [2] * 4, w)}   # loop 4, and its checks below
    write_tokens(tmp_path / "1" / "eval_tokens.csv", w, np.arange(4), np.zeros(4), np.zeros(4), np.zeros(4),
                 np.full((4, 1), 2), task={"answer": np.ones(4), "difficulty": np.ones(4), "correct": np.ones(4)},
                 cost=[5.0, 5.5, 5.0, 5.5])
    evs[0].update(ms_per_answer=2.0, ms_per_answer_ci=[1.5, 2.5])
    evs[1].update(ms_per_answer=3.0, ms_per_answer_ci=[2.0, 4.0])
    (r,), md = task_tables.best_fixed(tmp_path, evs, resamples=200)
    assert r["layer_applications"] == pytest.approx(5.25) and r["loop_layer_applications"] == pytest.approx(4.0)
    assert r["saving"] == pytest.approx(1 - 5.25 / 6)
    assert (r["ms_per_answer"], r["best_fixed_ms_per_answer"]) == (3.0, 2.0)
    assert "3.00 [2.00, 4.00]" in md and "best fixed: 2.00 [1.50, 2.50]" in md
