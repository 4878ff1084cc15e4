"""A multirun of the real CLI, in-process (Hydra's basic launcher, `recdepth.sweep.SweepSummary`
as its callback): a job that fails (recdepth/cli/runner.py `guarded`, `run_hydra_main`) and the
sweep's W&B table (recdepth/sweep.py `_wandb_table`), offline. The jobs reuse the session's
`tiny_ckpt` training run (same training identity: exit, eval, logger and callbacks are not
part of it), so nothing trains; make test-slow's sweeps in tests/cli/test_cli.py train their own."""

import csv
import json

import pytest

from recdepth.cli import runner as cli

# eval.latency_backend=null: the default (auto) compiles the timed step (~35 s; test_report's slow test)
EVAL = ["eval.tokens=4", "eval.latency_tokens=2", "eval.repeats=1", "eval.warmup_tokens=0", "eval.latency_backend=null"]


def sweep_in_process(tmp_path, tiny_ckpt, cli_here, monkeypatch, *args):
    """`python -m recdepth.train debug=tiny ... <args>` in this process (conftest's `cli_here`),
    with a fresh list of failed jobs (`cli._FAILED` lives as long as the process). Returns
    (exit status, stderr, the sweep directory)."""
    sweep = tmp_path / "sweep"
    runs = tiny_ckpt.parents[3] / "runs"  # tiny_ckpt's runs_dir: its training run is reused
    monkeypatch.setattr(cli, "_FAILED", [])
    code, err, _ = cli_here("recdepth.train", ["debug=tiny", "callbacks=none", *EVAL, f"runs_dir={runs}",
                                               f"hydra.sweep.dir={sweep}", *args], tmp_path)
    return code, err, sweep


def test_a_failed_job_writes_error_txt_the_sweep_goes_on_and_the_process_exits_1(tmp_path, tiny_ckpt, cli_here,
                                                                                 monkeypatch):
    """Job 1 (τ = −1) raises inside its job: its directory holds error.txt with the
    traceback and nothing else of a result; job 2, after it, still runs; the summary records
    it as failed beside the others; and the command exits 1 naming the failed job."""
    code, err, sweep = sweep_in_process(tmp_path, tiny_ckpt, cli_here, monkeypatch,
                                        "--multirun", "exit=accel", "exit.tau=1e-2,-1,1e-3")
    assert code == 1
    assert err.strip().splitlines()[-1] == f"1 job(s) failed: {sweep / '1'}"
    tb = (sweep / "1" / "error.txt").read_text()
    assert tb.startswith("Traceback (most recent call last):")
    assert tb.strip().splitlines()[-1] == "ValueError: exit.tau: expected a finite number > 0 for rule 'accel', got -1"
    assert not (sweep / "1" / "metrics.json").exists()
    for j, tau in (("0", 1e-2), ("2", 1e-3)):  # the jobs before and after the failure ran
        assert not (sweep / j / "error.txt").exists()
        ev = json.loads((sweep / j / "metrics.json").read_text())["eval"]
        assert (ev["exit"], ev["tau"], ev["tokens"]) == ("accel", tau, 4)
    rows = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert [(r["job"], r["tau"], r["status"]) for r in rows] == [("0", "0.01", "ok"), ("1", "-1", "failed"),
                                                                 ("2", "0.001", "ok")]
    assert rows[1]["error"] == tb.strip().splitlines()[-1] and rows[0]["error"] == rows[2]["error"] == ""
    assert "| failed: ValueError: exit.tau" in (sweep / "sweep_results.md").read_text()


def offline_table(sweep) -> dict:
    """The sweep summary's W&B table as the offline run wrote it."""
    (table,) = sweep.glob("wandb/offline-run-*/files/media/table/sweep/results_*.table.json")
    return json.loads(table.read_text())


def test_the_sweep_summary_logs_its_rows_to_a_wandb_table_offline(tmp_path, tiny_ckpt, cli_here, monkeypatch):
    """logger=wandb (WANDB_MODE=offline, no key): at the end of the multirun one W&B run of
    the sweep logs `sweep/results`, a table whose rows are sweep_results.csv's, column by
    column (applications per group joined with " / "), and `sweep/fig4`, Fig. 4's image."""
    code, err, sweep = sweep_in_process(tmp_path, tiny_ckpt, cli_here, monkeypatch, "logger=wandb",
                                        "--multirun", "exit=accel,kl", "exit.tau=1e-2")
    assert code == 0, err[-3000:]
    t = offline_table(sweep)
    rows = list(csv.DictReader(open(sweep / "sweep_results.csv")))
    assert len(rows) == len(t["data"]) == 2 and set(t["columns"]) == set(rows[0])
    assert t["columns"][-1] == "applications_per_token"
    for r, got in zip(rows, t["data"]):
        logged = dict(zip(t["columns"], got))
        assert (logged["job"], logged["exit"], logged["status"]) == (int(r["job"]), r["exit"], "ok")
        ev = json.loads((sweep / r["job"] / "metrics.json").read_text())["eval"]  # what the job measured
        assert (logged["exit"], logged["tau"], logged["ce"]) == (ev["exit"], ev["tau"], ev["ce"])
        assert logged["ce"] == pytest.approx(float(r["ce"]), rel=1e-12)
        assert logged["layer_applications"] == pytest.approx(float(r["layer_applications"]), rel=1e-12)
        assert logged["applications_per_token"] == r["applications_per_token"].replace(" ", " / ")
        reused = json.loads((sweep / r["job"] / "metrics.json").read_text()).get("reused", False)
        assert logged["overrides"] == r["overrides"] and logged["reused"] is reused is (r["reused"] == "True")
    (image,) = sweep.glob("wandb/offline-run-*/files/media/images/sweep/fig4_*.png")
    import matplotlib.image as mpimg

    assert (mpimg.imread(image) == mpimg.imread(sweep / "fig4_exits.png")).all()


@pytest.mark.slow  # default-suite time (make test-slow runs it): see docs/results/test-suite.md
def test_the_wandb_table_of_a_sweep_with_a_failed_job(tmp_path, tiny_ckpt, cli_here, monkeypatch):
    """A sweep with a failed job still logs its table, the failed job's row included."""
    code, _, sweep = sweep_in_process(tmp_path, tiny_ckpt, cli_here, monkeypatch, "logger=wandb",
                                      "--multirun", "exit=accel", "exit.tau=1e-2,-1")
    assert code == 1
    t = offline_table(sweep)
    rows = [dict(zip(t["columns"], r)) for r in t["data"]]
    assert [r["status"] for r in rows] == ["ok", "failed"]
    assert isinstance(rows[0]["ce"], float) and rows[1]["ce"] is None  # the failed job's cells: W&B's missing value
