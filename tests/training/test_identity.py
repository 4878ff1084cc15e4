"""The training identity hashes what changes the trained weights, and only that
(recdepth/training/runs.py: what_trains), and two jobs of one identity at once train it once (the
identity lock, TrainingRun.locked). Configs composed in-process with Hydra's compose API."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from recdepth.config.build import conf_dir
from recdepth.training.runs import training_identity, what_trains


def identity(*overrides: str) -> str:
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return training_identity(compose("config", overrides=list(overrides)))[0]


DEFAULT = identity()


@pytest.mark.parametrize("a, b", [
    (("model=single",), ("model=grouped", "model.groups=[[4,5,6,7]]")),  # one network, two labels
    (("sampler=fixed",), ("sampler=fixed", "sampler.sigma=0.9")),  # fixed never reads sigma
    ((), ("model.n_embd=128", "model.n_layer=12")),  # the cpu preset, spelled out
    ((), ("exit=kl", "exit.tau=0.5", "eval.tokens=8")),  # evaluation settings
    ((), ("exit=argmax_stability", "exit.patience=2")),  # ... SPEC §3b rules
    ((), ("exit=cosine", "exit.tau=[1e-3,1e-2,1e-3]", "exit.max_steps=[4,5,6]")),  # ... one value per group
    ((), ("trainer.val_check_interval=7", "trainer.enable_progress_bar=false")),  # reporting cadence
    ((), ("loss.steps=last", "loss.weights=linear")),  # the loss after the last application: runs before `loss`
])
def test_same_weights_same_identity(a, b):
    assert identity(*a) == identity(*b)


@pytest.mark.parametrize("change", [
    ("model.n_embd=64",), ("model.groups=[[4,5,6,7]]",), ("model=single",), ("sampler.sigma=0.9",),
    ("sampler.mean=8",), ("seed=1",), ("optim.lr=0.01",), ("model.size=paper",), ("trainer.max_steps=10",),
    ("loss.steps=all",), ("loss.anneal_to=all",),
])
def test_what_changes_the_weights_changes_the_identity(change):
    assert identity(*change) != DEFAULT


def test_what_trains_normalises_an_older_checkpoints_config():
    """A training config saved before name/size were normalised compares equal."""
    old = {"model": {"name": "grouped", "size": "cpu", "n_layer": None, "n_head": None, "n_embd": None,
                     "block_size": None, "groups": [[4]]},
           "sampler": {"name": "fixed", "mean": 4, "sigma": 0.5, "backprop_depth": 2},
           "trainer": {"max_steps": 10, "log_every_n_steps": 5}}
    new = {"model": {"n_layer": 12, "n_head": 4, "n_embd": 128, "block_size": 128, "groups": [[4]]},
           "sampler": {"name": "fixed", "mean": 4, "backprop_depth": 2}, "trainer": {"max_steps": 10}}
    assert what_trains(old) == new
    assert what_trains({**old, "loss": {"steps": "last", "weights": "uniform", "anneal_to": None}}) == new
    assert old["model"]["name"] == "grouped"  # a copy: the input is left as it was


def compose_cfg(*overrides: str):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_experiment_and_debug_groups():
    """experiment=cpu is the default run (same training identity); experiment=paper is
    the paper's (docs/spec.md §1: 12L/12H/d=768, block 512, groups 4, 5-6, 7, r = 12,
    k = 8, FineWeb, 60k steps of 10 x 512 = 307M tokens, bf16 on a GPU); debug=tiny's
    values yield to overrides given beside it."""
    assert identity("experiment=cpu") == DEFAULT
    p = compose_cfg("experiment=paper")
    assert (p.model.size, OmegaConf.to_object(p.model.groups)) == ("paper", [[4], [5, 6], [7]])
    assert (p.sampler.name, p.sampler.mean, p.sampler.backprop_depth) == ("lognormal_poisson", 12, 8)
    assert (p.data.source, p.data.max_tokens, p.trainer.precision) == ("fineweb", 300_000_000, "bf16-mixed")
    assert p.batch_size * 512 * p.trainer.max_steps == pytest.approx(300e6, rel=0.05)
    t = compose_cfg("debug=tiny", "trainer.max_steps=4")
    assert (t.trainer.max_steps, t.trainer.checkpoint_every, t.batch_size) == (4, 3, 2)
    t = compose_cfg("trainer.max_steps=4", "debug=tiny")  # the order on the command line does not matter
    assert t.trainer.max_steps == 4


@pytest.mark.parametrize("source, extra", [("shakespeare", ()), ("fineweb", ()), ("files", ("data.paths=[a.txt]",))])
def test_a_config_from_before_the_schema_has_the_same_identity(source, extra):
    """Before the schema a run's `data` held only its group file's keys; now it holds every
    key, the unread ones at their defaults. The identity (and a resume's comparison) reads
    the keys the source reads, a missing one at its default: the same either way."""
    cfg = compose_cfg(f"data={source}", *extra)
    old = OmegaConf.to_container(cfg)
    listed = {"shakespeare": {"source"},  # the keys conf/data/<source>.yaml set before the schema
              "fineweb": {"source", "max_tokens", "val_fraction", "val_tokens", "compact_vocab"},
              "files": {"source", "paths", "val_tokens", "compact_vocab"}}[source]
    old["data"] = {k: v for k, v in old["data"].items() if k in listed}
    assert set(old["data"]) < set(cfg.data)  # the old form really lacks keys
    assert training_identity(OmegaConf.create(old)) == training_identity(cfg)
    if source == "shakespeare":  # a key shakespeare does not read is no key of it
        with pytest.raises(Exception, match="text_column"):
            cfg.data.text_column = "body"
        return
    cfg.data.text_column = "body"  # a key the source reads
    assert training_identity(cfg)[0] != identity(f"data={source}", *extra)


def test_two_jobs_of_one_identity_at_once_train_it_once(tmp_path, env, monkeypatch, caplog):
    """The identity lock (TrainingRun.locked, a file lock on <runs_dir>/<identity>.lock): two
    train(cfg) calls of one training identity at once, in two threads, into two job dirs.
    Training is stubbed (it marks the run finished as `fit` does, after the second job has
    come to the lock); the lock, the reuse check and the rest of train() are the real ones.
    The second job waits for the first, says so in the log, and reuses its run."""
    import json
    import logging
    import threading

    import recdepth.train as T
    from recdepth.training.runs import TrainingRun

    for k in ("RECDEPTH_CACHE", "WANDB_MODE"):
        monkeypatch.setenv(k, env[k])
    waiting, entered = threading.Event(), threading.Event()
    fits = []

    class Seen(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("identity lock: "):
                waiting.set()

    def fit(cfg, run, job_dir, resume_step, lg):
        fits.append(job_dir.name)
        entered.set()
        if len(fits) > 1:  # a second training of the identity: the lock let it through
            waiting.set()
        waiting.wait(timeout=20)  # hold the lock until the other job has found it held
        run.ckpt.parent.mkdir(parents=True, exist_ok=True)
        run.ckpt.write_bytes(b"a checkpoint")
        metrics = {"val_ce": 1.0, "val_ppl": 2.718, "unigram_ce": 2.0, "steps": 3, "identity": run.identity}
        run.finish(metrics)
        return metrics

    monkeypatch.setattr(T, "fit", fit)
    caplog.set_level(logging.INFO, logger="recdepth.training.runs")
    seen = Seen()
    logging.getLogger("recdepth.training.runs").addHandler(seen)
    cfgs = {name: compose_cfg("debug=tiny", "eval.tokens=0", "callbacks=none", "logger=csv",
                              f"runs_dir={tmp_path / 'runs'}", f"run_dir={tmp_path / name}") for name in ("a", "b")}
    assert len({training_identity(c)[0] for c in cfgs.values()}) == 1
    results, errors = {}, []

    def job(name):
        try:
            results[name] = T.train(cfgs[name])
        except BaseException as e:  # noqa: B036 (reported by the main thread)
            errors.append(e)

    try:
        a = threading.Thread(target=job, args=("a",))
        a.start()
        assert entered.wait(timeout=20)  # a holds the lock, inside training
        b = threading.Thread(target=job, args=("b",))
        b.start()
        a.join(timeout=30)
        b.join(timeout=30)
    finally:
        logging.getLogger("recdepth.training.runs").removeHandler(seen)
    assert not errors and not a.is_alive() and not b.is_alive()
    assert fits == ["a"]  # trained once
    assert "reused" not in results["a"] and results["b"]["reused"] is True
    run = TrainingRun(cfgs["a"])
    assert results["a"]["train_dir"] == results["b"]["train_dir"] == str(run.dir)
    waited = [r for r in caplog.records if r.getMessage().startswith("identity lock: ")]
    assert len(waited) == 1 and f"{run.identity}.lock is held by another process" in waited[0].getMessage()
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["reused"] is True
