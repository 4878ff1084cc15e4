"""`python -m recdepth.diagnose` (recdepth/diagnose.py) on a tiny checkpoint, in-process: the
diagnostics file has the training callback's format and the checkpoint's step, its step
norms and cosines agree with a direct computation from the model's own trajectory on the
first held-out tokens, the figures are drawn, and bad input fails with one line."""

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from recdepth.config.build import conf_dir


def compose_diagnose(*overrides):
    with initialize_config_dir(conf_dir(), version_base="1.3"):
        return compose("diagnose", overrides=list(overrides))


SMALL = ["loop_dynamics.sequences=2", "loop_dynamics.seq_len=16", "loop_dynamics.loops=6",
         "loop_dynamics.pca_tokens=4", "device=cpu"]


@pytest.fixture(scope="module")
def done(tiny_ckpt, ckpt_env, tmp_path_factory):
    from recdepth.diagnose import diagnose

    out = tmp_path_factory.mktemp("diag") / "d"
    return out, diagnose(compose_diagnose(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL))


def test_diagnostics_match_a_direct_computation(done, tiny_ckpt):
    from recdepth.app.checkpoints import heldout_tokens, load_checkpoint

    out, metrics = done
    step = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)["global_step"]
    assert step > 0 and metrics["global_step"] == step
    d = json.loads((out / "diagnostics" / f"step_{step}.json").read_text())
    assert d["loops"] == 6 and d["batch"]["tokens"] == 32

    # the same model on the first 2 x 16 val tokens, its trajectory taken from the forward's
    # own trace with the diagnostics' noise seed, step norms and cosines computed here
    module, data = load_checkpoint(tiny_ckpt, torch.device("cpu"))
    idx = heldout_tokens(module, data, 32, 1337).view(2, 16)
    trace = []
    with torch.no_grad():
        module.model(idx, loops=[6] * module.model.n_groups, generator=torch.Generator().manual_seed(0),
                     trace=trace)
    groups = [states for kind, _, states in trace if kind == "group"]
    assert len(groups) == len(d["groups"]) == module.model.n_groups
    for states, rec in zip(groups, d["groups"]):
        x = torch.stack(states).double()  # [6, B, T, d]
        delta = x[1:] - x[:-1]  # steps Δ^(0..4)
        norms = delta.norm(dim=-1).flatten(1).mean(1)
        cos = torch.nn.functional.cosine_similarity(delta[1:], delta[:-1], dim=-1).flatten(1).mean(1)
        assert torch.allclose(norms, torch.tensor(rec["step_norm"]["mean"], dtype=torch.float64), rtol=1e-4)
        assert torch.allclose(cos, torch.tensor(rec["step_cosine"]["mean"], dtype=torch.float64), atol=1e-4)


def test_figures_and_metrics_are_written(done):
    out, metrics = done
    for name in ("fig1_pca", "fig2_dlr", "fig3_loop_dynamics", "fig5_cosines"):
        assert (out / "figures" / f"{name}.png").is_file(), name
    on_disk = json.loads((out / "metrics.json").read_text())
    assert on_disk["geometry"] == metrics["geometry"]
    assert any(k.startswith("geometry/dlr/") for k in on_disk["geometry"])


def test_refuses_a_used_dir_and_bad_settings(done, tiny_ckpt, ckpt_env):
    from recdepth.diagnose import diagnose

    out, _ = done
    with pytest.raises(FileExistsError, match="run_dir"):
        diagnose(compose_diagnose(f"ckpt={tiny_ckpt}", f"run_dir={out}", *SMALL))
    with pytest.raises(ValueError, match=r"^loop_dynamics\.loops: expected >= 3"):
        diagnose(compose_diagnose(f"ckpt={tiny_ckpt}", f"run_dir={out}x", *SMALL, "loop_dynamics.loops=2"))
    with pytest.raises(ValueError, match=r"^loop_dynamics\.seq_len: expected 2\.\."):
        diagnose(compose_diagnose(f"ckpt={tiny_ckpt}", f"run_dir={out}y", *SMALL, "loop_dynamics.seq_len=100000"))
