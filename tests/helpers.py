"""Helpers tests in several folders share: the training command in a subprocess, and the
argument lists of the debug-size runs."""

import subprocess
import sys

TINY = ["debug=tiny"]
# experiment=roots at debug size: a few records of every split, a short latency pass
SMALL = ["debug=tiny", "experiment=roots", "data.train_records=200", "data.test_records=6",
         "data.validation_records=12", "data.extrapolation_records=4", "eval.tokens=288",  # 6 records x 48
         "eval.latency_tokens=2", "eval.context_steps=4", "callbacks=none"]


def run(args, cwd, env, check=True):
    p = subprocess.run([sys.executable, "-m", "recdepth.train", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p
