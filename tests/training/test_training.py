"""Training safety: a diverged run stops with a clear message and keeps its last good checkpoint."""

import lightning as L
import pytest
import torch

from recdepth.training.lit import TrainingDiverged
from tests.tiny_fit import tiny_fit


class Poison(L.Callback):
    """After step `at`, write NaN into a parameter (a stand-in for an exploding update)."""

    def __init__(self, at: int, name: str, index=None):
        self.at, self.name, self.index = at, name, index

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.global_step == self.at:
            p = dict(pl_module.named_parameters())[self.name]
            with torch.no_grad():
                if self.index is None:
                    p.fill_(float("nan"))
                else:
                    p[self.index] = float("nan")


def saved_step(tmp):
    ck = torch.load(tmp / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert all(torch.isfinite(v).all() for v in ck["state_dict"].values() if v.is_floating_point())
    return ck["global_step"]


def test_a_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"train/loss is nan at step 3 \(optim.lr=0.001\): training diverged"):
        tiny_fit(tmp_path, [Poison(3, "model.wte.weight")], max_steps=8, checkpoint_every=2)
    assert saved_step(tmp_path) == 2  # the step-2 checkpoint, untouched


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    # NaN in a padded LM-bias entry: the loss stays finite (padded logits are masked to
    # -inf), so only the checkpoint guard can notice.
    with pytest.raises(TrainingDiverged, match="non-finite weights at step 4 .*the checkpoint was not written"):
        tiny_fit(tmp_path, [Poison(3, "model.lm_bias", index=-1)], max_steps=8, checkpoint_every=2)
    assert saved_step(tmp_path) == 2
