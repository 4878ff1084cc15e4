"""The config schema (recdepth/config/schema.py): every shipped config composes onto it and
validates; a bad value, a wrong type or an unknown key fails with one line naming the
field; the schema's defaults are the YAML's. Configs composed in-process with Hydra's
compose API, as the command line composes them."""

import dataclasses
import itertools
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from recdepth.config import groups, schema
from recdepth.config import training as training_schema
from recdepth.config.build import conf_dir, data_module, exit_policy, model_config, sampler_args
from recdepth.data import sources, tasks

CONF = Path(conf_dir())


def compose_cfg(*overrides: str, config: str = "config"):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose(config, overrides=["run_dir=/tmp/unused", *overrides])


def choices(group: str) -> list[str]:
    """A group's options as Hydra lists them: conf/<group>/*.yaml, and the options the schema
    stores in the ConfigStore (the `exit` group: one per registered rule)."""
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


GROUPS = {g: choices(g) for g in ("model", "sampler", "exit", "data", "trainer", "logger")}
NEEDS = {"data=files": ["data.paths=/data/*.txt"]}  # files has no default paths


def overrides_of(row: dict) -> list[str]:
    out = [f"{g}={c}" for g, c in row.items()]
    return out + [o for g, c in row.items() for o in NEEDS.get(f"{g}={c}", [])]


def pairwise(groups: dict[str, list[str]]) -> list[dict]:
    """Rows (one choice per group) in which every choice of every group meets every choice
    of every other group at least once: far fewer rows than the full product."""
    names = list(groups)

    def key(a, x, b, y):
        return (a, x, b, y) if names.index(a) < names.index(b) else (b, y, a, x)

    todo = {key(a, x, b, y) for a, b in itertools.combinations(names, 2) for x in groups[a] for y in groups[b]}
    rows = []
    while todo:
        a, x, b, y = min(todo)
        row = {a: x, b: y}
        for g in names:
            if g not in row:
                row[g] = max(groups[g], key=lambda v, g=g: sum(key(p, row[p], g, v) in todo for p in row))
        todo -= {key(a, row[a], b, row[b]) for a, b in itertools.combinations(names, 2)}
        rows.append(row)
    return rows


def test_pairwise_covers_every_pair():
    rows = pairwise(GROUPS)
    for a, b in itertools.combinations(GROUPS, 2):
        assert {(r[a], r[b]) for r in rows} == set(itertools.product(GROUPS[a], GROUPS[b])), (a, b)
    assert len(rows) < 0.2 * len(list(itertools.product(*GROUPS.values())))


def check_choices(run: schema.TrainConfig, row: dict) -> None:
    """The typed config is the one the choices name."""
    assert run.model.name == row["model"] and run.sampler.name == row["sampler"] and run.exit.name == row["exit"]
    assert row["data"] in (run.data.source, getattr(getattr(run.data, "task", None), "name", None))
    assert (run.logger.wandb is not None) == (row["logger"] == "wandb")
    assert (run.trainer.strategy, run.trainer.accelerator) == {
        "default": ("auto", "auto"), "gpu": ("auto", "gpu"), "ddp": ("ddp", "auto")}[row["trainer"]]
    assert (run.callbacks.loop_dynamics is None) == (row["model"] == "baseline")


@pytest.fixture
def cuda(monkeypatch):
    """trainer=gpu asks for a GPU: checking the shipped configs, not this machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.mark.parametrize("row", pairwise(GROUPS), ids=lambda r: ",".join(r[g] for g in GROUPS))
def test_every_pair_of_shipped_choices_composes_and_validates(cuda, row):
    check_choices(schema.validated(compose_cfg(*overrides_of(row))), row)


@pytest.mark.slow
def test_every_combination_of_shipped_choices_composes_and_validates(cuda):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        for combo in itertools.product(*GROUPS.values()):
            row = dict(zip(GROUPS, combo))
            check_choices(schema.validated(compose("config", overrides=["run_dir=/x", *overrides_of(row)])), row)


def test_experiments_and_debug_validate(cuda):
    paper = schema.validated(compose_cfg("experiment=paper"))
    assert paper.model.shape() == {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 512}
    assert (paper.data.source, paper.trainer.precision, paper.sampler.backprop_depth) == ("fineweb", "bf16-mixed", 8)
    cpu = schema.validated(compose_cfg("experiment=cpu"))
    assert cpu.model.shape()["n_embd"] == 128 and cpu.trainer.max_steps == 800
    tiny = schema.validated(compose_cfg("debug=tiny"))
    assert (tiny.batch_size, tiny.trainer.max_steps, tiny.eval.tokens) == (2, 3, 6)
    both = schema.validated(compose_cfg("experiment=paper", "debug=tiny"))
    assert (both.model.size, both.trainer.max_steps) == ("paper", 3)


def test_callbacks_none_validates_for_every_model():
    for m in GROUPS["model"]:
        assert schema.validated(compose_cfg(f"model={m}", "callbacks=none")).callbacks.loop_dynamics is None


# --------------------------------------------------------------- refusals
def one_line(msg: str, field: str) -> None:
    assert "\n" not in msg and msg.startswith(f"{field}: "), msg


@pytest.mark.parametrize("overrides, field, expected", [
    (["seed=-1"], "seed", ">= 0"),
    (["batch_size=0"], "batch_size", ">= 1"),
    (["model.n_layer=0"], "model.n_layer", "positive integer"),
    (["model.groups=[[4],[12]]"], "model.groups", "out of range 0..11"),
    (["model.state_init=ones"], "model.state_init", "normal, zero, input"),
    (["sampler.sigma=-0.5"], "sampler.sigma", ">= 0"),
    (["sampler=fixed", "sampler.mean=2.5"], "sampler.mean", "integer loop count"),
    (["exit.max_steps=0"], "exit.max_steps", ">= 1"),
    (["exit=kl", "exit.tau=0"], "exit.tau", "> 0"),
    (["exit=cosine", "exit.tau=[1e-3,1e-2]"], "exit.tau", "a list of 2 for 3 recurrence groups"),
    (["exit=kl", "exit.tau=[1e-3,0,1e-3]"], "exit.tau[1]", "> 0"),
    (["exit.max_steps=[8,8,8,8]"], "exit.max_steps", "a list of 4 for 3 recurrence groups"),
    (["exit.min_steps=[0,9,0]", "exit.max_steps=8"], "exit.max_steps", "8 (group 1) is smaller than exit.min_steps=9"),
    (["model=baseline", "callbacks=none", "exit=entropy_diff", "exit.tau=[1e-3]"], "exit.tau",
     "the model has no recurrence groups"),
    (["exit.max_steps=abc"], "exit.max_steps", "expected an integer >= 1, got 'abc'"),
    (["exit=argmax_stability", "exit.patience=0"], "exit.patience", ">= 1"),
    (["exit=oracle", "exit.tau=[0.1,0.1,0.1]"], "exit.tau", "the oracle takes one value"),
    (["data.val_fraction=1.5"], "data.val_fraction", "(0, 1)"),
    (["data.val_tokens=0"], "data.val_tokens", ">= 1 or null"),
    (["data.source=books"], "data.source", "composed as data=shakespeare, got 'books'"),
    (["data=fineweb", "data.max_tokens=null"], "data.max_tokens", "required for data=fineweb from the hub"),
    (["data=files", "data.paths=[]"], "data.paths", "required for data=files"),
    (["data=files", "data.paths=x.txt", "data.encoding=klingon"], "data.encoding", "unknown text encoding"),
    (["data=modsum", "data.task.modulus=11"], "data.task.modulus", "expected an integer in 2..10"),
    (["data=hops", "data.task.layout=random"], "data.task.layout", "shuffled, sorted"),
    (["data=modsum", "data.task.name=hops"], "data.task.name", "composed as data=modsum, got 'hops'"),
    (["data=addition", "data.loss=some"], "data.loss", "all, answers"),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps", ">= 1"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val", ">= 0 or null"),
    (["trainer.accelerator=tpu"], "trainer.accelerator", "auto, cpu, gpu"),
    (["trainer.devices=0"], "trainer.devices", ">= 1"),
    (["trainer.peak_flops=0"], "trainer.peak_flops", "> 0 or null"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio", "[0, 1]"),
    (["optim.eps=-1e-8"], "optim.eps", ">= 0"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps", ">= 0"),
    (["eval.repeats=0"], "eval.repeats", ">= 1"),
    (["eval.tokens=-1"], "eval.tokens", ">= 0"),
    (["logger=wandb", "logger.wandb.mode=sometimes"], "logger.wandb.mode", "auto, online, offline, disabled"),
    (["callbacks.loop_dynamics.sequences=0"], "callbacks.loop_dynamics.sequences", ">= 1"),
    (["callbacks.loop_dynamics.pca_sequence=4"], "callbacks.loop_dynamics.pca_sequence", "(0..3)"),
    (["callbacks.loop_dynamics.every_n_steps=0"], "callbacks.loop_dynamics.every_n_steps", ">= 1"),
    (["callbacks.loop_dynamics.seq_len=1"], "callbacks.loop_dynamics.seq_len", "2..128"),
])
def test_an_out_of_range_value_is_refused_in_one_line(overrides, field, expected):
    cfg = compose_cfg(*overrides)  # composes: the types are right
    with pytest.raises(ValueError) as e:
        schema.validated(cfg)
    one_line(str(e.value), field)
    assert expected in str(e.value)


@pytest.mark.parametrize("overrides, field, expected", [
    (["ckpt=x.ckpt", "device=gpu"], "device", "auto, cpu, cuda or cuda:<n>"),
    (["ckpt=x.ckpt", "eval.tokens=0"], "eval.tokens", ">= 1"),
    (["ckpt=x.ckpt", "eval.context_steps=0"], "eval.context_steps", "an integer >= 1 or null"),
    (["ckpt=x.ckpt", "exit.tau=-1"], "exit.tau", "> 0"),
    (["ckpt=x.ckpt", "exit=argmax_stability", "exit.patience=-1"], "exit.patience", ">= 1"),
    (["ckpt=x.ckpt", "exit=cosine", "exit.tau=[1e-3,-1]"], "exit.tau[1]", "> 0"),
    ([], "ckpt", "give exactly one of ckpt=<training checkpoint> or hf=<Hugging Face checkpoint directory>, got neither"),
    (["ckpt=x.ckpt", "hf=/d"], "ckpt", "got both"),
    (["ckpt=x.ckpt", "data=shakespeare"], "data", "a training checkpoint carries its own data config"),
    (["hf=/d", "dtype=int8"], "dtype", "expected one of float32, bfloat16, float16"),
])
def test_evaluate_config_is_checked(overrides, field, expected):
    cfg = compose_cfg(*overrides, config="evaluate")
    assert OmegaConf.get_type(cfg) is schema.EvaluateConfig
    with pytest.raises(ValueError) as e:
        schema.validated(cfg)
    one_line(str(e.value), field)
    assert expected in str(e.value)
    assert isinstance(schema.validated(compose_cfg("ckpt=x.ckpt", config="evaluate")), schema.EvaluateConfig)


@pytest.mark.parametrize("override, field, expected", [
    ("seed=abc", "seed", "expected an integer, got 'abc'"),
    ("trainer.max_steps=1.5", "trainer.max_steps", "expected an integer"),
    ("trainer.compile=maybe", "trainer.compile", "maybe"),
    ("optim.lr=fast", "optim.lr", "expected a number"),
    ("exit.patience=abc", "exit.patience", "expected an integer, got 'abc'"),
    ("exit.patience=2.5", "exit.patience", "expected an integer"),
    ("model.groups=[[4],[x]]", "model.groups[1]", "int"),
    ("optim.betas=0.9", "optim.betas", "list"),
    ("trainer.max_step=3", "trainer.max_step", "no such key in trainer (did you mean max_steps?)"),
    ("data.val_tokenz=1", "data.val_tokenz", "no such key in data (did you mean val_tokens?)"),
    # a key of another source (or another task) is no key of this one
    ("data.text_column=body", "data.text_column", "no such key in data (its keys: source, val_tokens,"),
    ("data.modulus=7", "data.modulus", "no such key in data"),
    ("foo=1", "foo", "no such key in the config"),
])
def test_a_wrong_type_or_unknown_key_fails_composing_in_one_line(override, field, expected):
    with pytest.raises(Exception) as e:
        compose_cfg(override)
    msg = schema.config_error(e.value)
    one_line(msg, field)
    assert expected in msg


def test_a_key_added_with_plus_is_refused():
    cfg = compose_cfg("+trainer.max_stepz=3")  # Hydra adds it (force_add), the schema refuses it
    with pytest.raises(ValueError) as e:
        schema.validated(cfg)
    one_line(str(e.value), "trainer.max_stepz")


def test_config_error_leaves_other_errors_alone():
    assert schema.config_error(ValueError("x")) is None
    assert schema.config_error(RuntimeError("y")) is None


@pytest.mark.parametrize("overrides, expected", [
    (["seed=abc"], "error: seed: expected an integer, got 'abc'"),
    # OmegaConf asserts without naming the key when its parent node is null
    (["callbacks=none", "callbacks.loop_dynamics.loops=5"],
     "error: callbacks.loop_dynamics.loops: callbacks.loop_dynamics is null in this config"),
])
def test_the_command_line_prints_a_composition_error_in_one_line(monkeypatch, tmp_path, overrides, expected):
    """`python -m recdepth.train seed=abc`, in-process: Hydra's multi-line composition
    report becomes one line naming the field (recdepth/cli/runner.py: run_hydra_main)."""
    import hydra._internal.utils as hydra_utils

    from recdepth.train import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["recdepth.train", *overrides, f"run_dir={tmp_path / 'run'}"])
    report = hydra_utils.run_and_report
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        GlobalHydra.instance().clear()
    assert e.value.code.startswith(expected) and "\n" not in e.value.code
    assert hydra_utils.run_and_report is report  # put back
    assert not (tmp_path / "run").exists()


def test_the_hydra_internals_recdepth_reads_are_there():
    """recdepth/cli/runner.py reaches into Hydra in one place (`one_line_errors`): the function
    it wraps and the frame whose locals it reads. A Hydra release that moves either fails
    here, by name, before any command's error turns into Hydra's multi-line report."""
    import importlib

    import hydra

    from recdepth.cli import runner as cli

    module, name = cli.HYDRA_REPORT
    assert callable(getattr(importlib.import_module(module), name, None)), \
        f"hydra {hydra.__version__}: {module}.{name} is gone; update recdepth/cli/runner.py one_line_errors"
    module, cls, method = cli.HYDRA_OVERRIDE_FRAME
    fn = getattr(getattr(importlib.import_module(module), cls, None), method, None)
    assert fn is not None and "key" in fn.__code__.co_varnames, \
        f"hydra {hydra.__version__}: {module}.{cls}.{method} (with a local `key`) is gone; update _override_under_null"


def test_a_ddp_ranks_config_file_is_validated_against_the_schema(tmp_path):
    """A DDP rank > 0 reads <run_dir>/config.yaml without Hydra (train.ddp_rank): the same
    schema applies to it."""
    cfg = compose_cfg("debug=tiny", "model=single")
    f = tmp_path / "config.yaml"
    f.write_text(OmegaConf.to_yaml(cfg, resolve=True))  # as train() writes it
    loaded = OmegaConf.load(f)
    assert OmegaConf.get_type(loaded) is dict  # plain YAML, no schema attached
    assert schema.validated(loaded) == schema.validated(cfg)
    loaded.trainer.max_steps = 0
    with pytest.raises(ValueError) as e:
        schema.validated(loaded)
    one_line(str(e.value), "trainer.max_steps")
    loaded.trainer.max_steps = 3
    loaded.trainer.max_stepz = 3
    with pytest.raises(ValueError) as e:
        schema.validated(loaded)
    one_line(str(e.value), "trainer.max_stepz")
    with pytest.raises(ValueError) as e:
        schema.validated(OmegaConf.create({"seed": "abc"}))
    one_line(str(e.value), "seed")


# --------------------------------------------------------------- defaults
def yaml_of(path: Path) -> dict:
    d = OmegaConf.to_container(OmegaConf.load(path))
    d.pop("defaults", None)
    return d


# The default choice of each group (conf/config.yaml's defaults list) and its dataclass.
DEFAULT_CHOICE = {"model": ("grouped", groups.ModelConfig), "sampler": ("lognormal_poisson", groups.SamplerConfig),
                  "trainer": ("default", training_schema.TrainerConfig)}  # exit: no files (test_the_exit_group_is_the_registry)
# Keys whose schema default is not every group file's value, by design: the schema's is
# the default choice's (or, for a key the default choice does not set, null).
DIFFERS: dict = {}  # none (data has no files: test_the_data_group_is_the_registry)


def yaml_defaults(name: str) -> list:
    return OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))["defaults"]


def test_the_exit_group_is_the_registry():
    """`exit=<name>` options are the registered rules (recdepth/exits/rules/builtin.py), fixed's alias
    none and the oracle, no file each: an option is the rule's name and its own default τ."""
    from recdepth import exits

    assert not (CONF / "exit").exists()
    assert GROUPS["exit"] == sorted([*exits.names(), "none", "oracle"])
    for name in GROUPS["exit"]:
        e = schema.validated(compose_cfg(f"exit={name}")).exit
        tau = exits.ORACLE_EPSILON if name == "oracle" else None if name == "none" else exits.lookup(name).default_tau
        assert (e.name, e.tau) == (name, tau)
        dflt = groups.ExitConfig()
        assert dataclasses.replace(e, tau=dflt.tau, name=dflt.name) == dflt  # only those differ
    # every command's default rule is one rule, the schema's (`exits.DEFAULT_RULE`), named in each defaults list
    assert groups.ExitConfig().name == exits.DEFAULT_RULE
    assert groups.ExitConfig().tau == exits.lookup(exits.DEFAULT_RULE).default_tau
    for name in ("config", "evaluate", "calibrate", "generate"):
        chosen = [d["exit"] for d in yaml_defaults(name) if isinstance(d, dict) and "exit" in d]
        assert chosen == [exits.DEFAULT_RULE], name


def test_the_default_choices_are_the_default_run():
    defaults = [d for d in OmegaConf.to_container(OmegaConf.load(CONF / "config.yaml"))["defaults"]
                if isinstance(d, dict)]
    chosen = {k: v for d in defaults for k, v in d.items()}
    assert {g: chosen[g] for g in DEFAULT_CHOICE} == {g: c for g, (c, _) in DEFAULT_CHOICE.items()}


@pytest.mark.parametrize("group", DEFAULT_CHOICE)
def test_schema_defaults_equal_the_yaml_defaults(group):
    """Every key of the group's dataclass: its default is the default choice's YAML value;
    a key the default choice does not set has the value of every other file that sets it
    (except DIFFERS; exit and model options hold only what differs, so an option's values
    are its own: test_group_options_hold_only_what_differs_from_the_schema). Only the schema
    defines a key that no file sets."""
    choice, cls = DEFAULT_CHOICE[group]
    files = {c: yaml_of(CONF / group / f"{c}.yaml") for c in choices(group)}
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name in files[choice]:
            assert files[choice][f.name] == default, (group, f.name)
        elif (group, f.name) not in DIFFERS and group not in IDENTITY:
            for c, d in files.items():
                assert d.get(f.name, default) == default, (group, c, f.name)
    for c, d in files.items():  # every key a file sets is a schema key
        assert set(d) <= {f.name for f in dataclasses.fields(cls)}, (group, c)


def test_optional_group_defaults_equal_the_yaml_defaults():
    """The optional groups (loop_dynamics, wandb) against their dataclasses."""
    ld = yaml_of(CONF / "callbacks" / "loop_dynamics.yaml")["loop_dynamics"]
    assert ld.pop("every_n_steps") == "${trainer.checkpoint_every}"  # the schema's default is that key's default
    assert training_schema.LoopDynamicsConfig().every_n_steps == training_schema.TrainerConfig().checkpoint_every
    assert ld == {k: v for k, v in dataclasses.asdict(training_schema.LoopDynamicsConfig()).items() if k != "every_n_steps"}
    assert yaml_of(CONF / "logger" / "wandb.yaml")["wandb"] == dataclasses.asdict(training_schema.WandbConfig())
    assert yaml_of(CONF / "logger" / "csv.yaml") == dataclasses.asdict(training_schema.LoggerConfig())
    assert yaml_of(CONF / "callbacks" / "none.yaml") in ({}, None) and training_schema.CallbacksConfig().loop_dynamics is None


@pytest.mark.parametrize("name", ["config", "evaluate", "calibrate", "report", "generate", "diagnose", "train_gate"])
def test_a_command_yaml_holds_no_value_of_the_schema(name):
    """Defaults live in the schema's dataclasses only: a command's conf/<name>.yaml holds its
    defaults list (the schema root, the group choices), run_dir and Hydra's own settings."""
    y = OmegaConf.to_container(OmegaConf.load(CONF / f"{name}.yaml"))
    assert set(y) == {"defaults", "run_dir", "hydra"}, sorted(y)
    assert y["run_dir"] == "${hydra:runtime.output_dir}"
    assert y["defaults"][0] == f"{'train' if name == 'config' else name}_schema"


def test_the_data_group_is_the_registry():
    """`data=<name>` options are the registered sources (recdepth/data/sources/) and tasks
    (recdepth/data/tasks/: the task source with that task), no file each: an option is its
    class at its defaults, conf/config.yaml choosing shakespeare."""
    assert not (CONF / "data").exists()
    assert GROUPS["data"] == sorted([*sources.names(), *tasks.names()])
    for name in GROUPS["data"]:
        d = schema.validated(compose_cfg(f"data={name}", *NEEDS.get(f"data={name}", []))).data
        if name in sources.names():
            assert type(d) is sources.lookup(name) and d.source == name
        else:
            assert type(d) is sources.TaskData and type(d.task) is tasks.lookup(name)
            assert dataclasses.replace(d, task=tasks.Hops()) == sources.TaskData()  # only the task differs
            assert d.task == tasks.lookup(name)()
    assert type(schema.validated(compose_cfg()).data) is sources.ShakespeareData


# ------------------------------------------------------------ built objects
def test_objects_are_built_from_the_typed_config():
    cfg = compose_cfg("model=single", "sampler=fixed", "sampler.mean=4", "exit=kl", "exit.tau=0.01",
                      "data=files", "data.paths=/data/a.txt", "model.n_embd=64")
    run = schema.validated(cfg)
    m = model_config(run, vocab_size=100)
    assert (m.groups, m.n_embd, m.n_layer, m.mean_recurrence, m.vocab_size) == ([[4, 5, 6, 7]], 64, 12, 4.0, 100)
    assert sampler_args(run) == {"name": "fixed", "mean": 4.0, "sigma": 0.0, "backprop_depth": 8}
    p = exit_policy(run)
    assert (p.name, p.tau, p.max_steps) == ("kl", 0.01, 32)
    dm = data_module(run, block_size=32)
    assert dm.data.paths == ["/data/a.txt"] and dm.data.source == "files" and dm.block_size == 32
    # the composed DictConfig builds the same objects (validated on the way in)
    assert model_config(cfg, vocab_size=100) == m and sampler_args(cfg) == sampler_args(run)


def test_per_group_exit_values_build_one_policy_per_group():
    """`exit.tau`, `exit.min_steps`, `exit.max_steps` take one value per group (SPEC §3b):
    the training config checks the lists against model.groups; an evaluation's checkpoint
    is not known yet, so its config takes any length (checked against the checkpoint)."""
    run = schema.validated(compose_cfg("exit=cosine", "exit.tau=[1e-3,1e-2,1e-3]", "exit.max_steps=[32,16,8]"))
    p = exit_policy(run)
    assert (p.tau, p.max_steps, p.n_groups, p.max_steps_bound) == ((1e-3, 1e-2, 1e-3), (32, 16, 8), 3, 32)
    assert (p.group(1).tau, p.group(1).max_steps) == (1e-2, 16)
    k = exit_policy(compose_cfg("exit=argmax_stability", "exit.patience=2", "exit.min_steps=[0,3,0]"))
    assert (k.name, k.patience, k.min_steps, k.tau) == ("argmax_stability", 2, (0, 3, 0), None)
    single = schema.validated(compose_cfg("model=single", "exit=entropy_diff", "exit.tau=[1e-3]"))
    assert exit_policy(single).group(0).tau == 1e-3
    ev = compose_cfg("ckpt=x.ckpt", "exit=cosine", "exit.tau=[1e-3,1e-2]", config="evaluate")
    assert exit_policy(ev).tau == (1e-3, 1e-2)
    with pytest.raises(ValueError) as e:
        exit_policy(ev).check_groups(3)  # what recdepth.evaluate does with the checkpoint's model
    one_line(str(e.value), "exit.tau")



ROOT_YAML = {"train_schema": "config", "evaluate_schema": "evaluate", "calibrate_schema": "calibrate",
             "report_schema": "report", "train_gate_schema": "train_gate", "diagnose_schema": "diagnose",
             "generate_schema": "generate"}
IDENTITY = {"model": {"name", "groups"}, "sampler": {"name"},
            "trainer": set()}  # what names an option, even when it is the default


def _defaults(cls) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cls), resolve=False, throw_on_missing=False)


def _leaves(node: dict, dflt, path=""):
    for k, v in node.items():
        if k in ("defaults", "hydra"):
            continue
        dv = dflt.get(k, "<no such key>") if isinstance(dflt, dict) else "<no such key>"
        if isinstance(v, dict) and isinstance(dv, dict):
            yield from _leaves(v, dv, f"{path}{k}.")
        else:
            yield f"{path}{k}", v, dv


@pytest.mark.parametrize("schema_name", sorted(ROOT_YAML))
def test_root_yaml_values_are_the_schema_defaults(schema_name):
    """The schema is where a default is written: a root config (conf/<entry>.yaml) lists its
    keys for the reader, and every value it writes is the schema's default."""
    import yaml

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import ROOTS

    y = yaml.safe_load((Path(conf_dir()) / f"{ROOT_YAML[schema_name]}.yaml").read_text())
    wrong = [(p, v, dv) for p, v, dv in _leaves(y, _defaults(ROOTS[schema_name])) if v != dv]
    assert wrong == [], f"conf/{ROOT_YAML[schema_name]}.yaml disagrees with recdepth/config/schema.py: {wrong}"


@pytest.mark.parametrize("group", sorted(IDENTITY))
def test_group_options_hold_only_what_differs_from_the_schema(group):
    """conf/{exit,model,data,sampler,trainer}/*.yaml hold only what differs from the schema's
    defaults (and the option's name; a model's groups): no file restates a default."""
    import yaml

    from recdepth.config.build import conf_dir
    from recdepth.config.schema import TrainConfig

    dflt = _defaults(TrainConfig)[group]
    files = sorted((Path(conf_dir()) / group).glob("*.yaml"))
    assert len(files) >= 2
    for f in files:
        y = yaml.safe_load(f.read_text()) or {}
        restated = [p for p, v, dv in _leaves(y, dflt) if v == dv and p not in IDENTITY[group]]
        unknown = [p for p, v, dv in _leaves(y, dflt) if dv == "<no such key>"]
        assert restated == [] and unknown == [], f"{f}: restates {restated}, unknown {unknown}"


@pytest.mark.parametrize("schema_name", sorted(ROOT_YAML))
def test_one_spelling_per_knob_across_commands(schema_name):
    """The decoding knobs are `eval.cache`, `eval.warm_start`, `eval.backend` in every command
    that has them (DecodeConfig's fields), never a top-level or other spelling."""
    from recdepth.config.groups import DecodeConfig
    from recdepth.config.schema import ROOTS

    knobs = {f.name for f in dataclasses.fields(DecodeConfig)}
    paths = [p for p, _, _ in _leaves(_defaults(ROOTS[schema_name]), {})]
    stray = [p for p in paths if p.split(".")[-1] in knobs and p.rsplit(".", 1)[0] != "eval"]
    assert stray == [], f"{schema_name}: decoding knobs outside eval: {stray}"
    if any(p.startswith("eval.") for p in paths):
        assert knobs <= {p.split(".", 1)[1] for p in paths if p.startswith("eval.")}


def test_an_older_runs_eval_block_is_read_as_it_was_written():
    """A config.yaml from before `eval.backend` (then `eval.step`) and `eval.latency_backend`
    (then `eval.latency_step`), and before `answers` and `context_steps`: its own values under
    the old names, the missing keys as the code before them read them."""
    from omegaconf import OmegaConf

    from recdepth.app.jobs import decode_settings

    old = OmegaConf.create({"seed": 3, "eval": {"cache": "per_step", "warm_start": False, "step": "compiled",
                                                "latency_step": "module", "batch_size": 2, "warmup_tokens": 1,
                                                "latency_tokens": 4, "repeats": 1}})
    got = decode_settings(old)
    assert (got.backend, got.latency_backend, got.cache, got.batch_size) == ("compiled", "module", "per_step", 2)
    assert (got.context_steps, got.answers, got.seed) == (None, None, 3)
    new = OmegaConf.create({"seed": 3, "eval": {**old.eval, "backend": "lean"}})
    assert decode_settings(new).backend == "lean"  # the current name wins where both are there


def test_the_eval_block_is_the_engines_decode_settings():
    """One settings object: every decode key of the `eval` block is a `DecodeSettings` field
    the commands hand to the engine (`jobs.decode_settings`), validated by it alone
    (the same one-line error from the config as from the library), and the keys whose
    default is the library's take it from DecodeSettings, not a copy."""
    from recdepth.app.jobs import decode_settings
    from recdepth.decode.settings import DecodeSettings

    cfg = compose_cfg("eval.cache=per_step", "eval.warm_start=true", "eval.context_steps=3", "seed=11",
                      "ckpt=/tmp/unused.ckpt", config="evaluate")
    got = decode_settings(cfg, bos=5)
    assert isinstance(got, DecodeSettings)
    assert (got.cache, got.warm_start, got.context_steps, got.seed, got.bos) == ("per_step", True, 3, 11, 5)
    assert (got.backend, got.batch_size, got.latency_backend) == (cfg.eval.backend, cfg.eval.batch_size, cfg.eval.latency_backend)
    assert decode_settings(schema.validated(cfg), bos=5) == got  # the validated object gives the same settings
    shared = {f.name for f in dataclasses.fields(DecodeSettings)} & {f.name for f in dataclasses.fields(groups.EvalConfig)}
    assert shared >= {"cache", "warm_start", "backend", "context_steps", "batch_size", "warmup_tokens", "latency_tokens",
                      "repeats", "latency_backend", "answers"}
    for name in ("cache", "warm_start", "warmup_tokens", "context_steps", "answers"):
        assert getattr(groups.EvalConfig, name) == getattr(DecodeSettings, name), name
    for bad, field in (("eval.cache=both", "eval.cache"), ("eval.backend=fast", "eval.backend"),
                       ("eval.context_steps=0", "eval.context_steps")):
        with pytest.raises(ValueError, match=f"^{field}: expected") as from_config:
            schema.validated(compose_cfg(bad, "ckpt=/tmp/unused.ckpt", config="evaluate"))
        key, value = bad.split("=")
        with pytest.raises(ValueError) as from_library:
            DecodeSettings(**{key.split(".")[1]: int(value) if value.isdigit() else value})
        assert str(from_config.value) == str(from_library.value)
    frozen = DecodeSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        frozen.cache = "per_step"
    assert frozen.replace(cache="per_step").cache == "per_step" and frozen.cache == "latest"


def test_evaluate_validates_its_config_once(tiny_ckpt, ckpt_env, tmp_path, monkeypatch):
    """`recdepth evaluate` checks the composed config once and hands the typed object down
    (exit_policy, open_model): counted at the one function that validates a raw config."""
    from recdepth import evaluate as evaluate_module
    from recdepth.cli.runner import compose_job
    from recdepth.config import build, schema

    calls = []
    real = schema.validated

    def counted(cfg):
        calls.append(type(cfg).__name__)
        return real(cfg)

    for module in (schema, build, evaluate_module):
        monkeypatch.setattr(module, "validated", counted)
    cfg = compose_job("evaluate", [f"ckpt={tiny_ckpt}", "eval.tokens=24", "eval.latency_tokens=0",
                                   f"run_dir={tmp_path / 'e'}"])
    evaluate_module.evaluate(cfg)
    assert calls == ["DictConfig"]


@pytest.mark.parametrize("override", ["data.val_tokens=100", "data.task.size=[2,4]"])
def test_a_data_override_on_a_checkpoint_is_one_line(monkeypatch, tmp_path, override):
    """`recdepth evaluate ckpt=... data.task.size=[2,4]`: the data config is the checkpoint's, so a
    data.* override is refused in one line naming the key (it ended in OmegaConf's bare
    AssertionError, a traceback)."""
    from recdepth.evaluate import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["recdepth.evaluate", "ckpt=x.ckpt", override, f"run_dir={tmp_path / 'run'}"])
    try:
        with pytest.raises(SystemExit) as e:
            main()
    finally:
        GlobalHydra.instance().clear()
    key = override.split("=")[0]
    assert e.value.code.startswith(f"error: {key}: no data group here: a training checkpoint (ckpt=) carries "
                                   "its own data config") and "\n" not in e.value.code
