"""Loop-count samplers: how many applications each recurrence group gets per forward pass.

Training draws the count per group and per pass from Geiping et al.'s lognormal-Poisson
schedule (SPEC §1); a paired group (layers 5-6) is one group, so it gets one draw for
both layers. Validation uses the `fixed` sampler, n = r. Each sampler owns a seeded
`torch.Generator`, and its state is saved with the checkpoint, so draws are reproducible
from the seed and continue exactly after a resume.
"""

from __future__ import annotations

import math

import torch

SAMPLERS = ("lognormal_poisson", "fixed")


def lognormal_poisson(mean: float, sigma: float, generator: torch.Generator) -> int:
    """One draw of Geiping et al.'s schedule (SPEC §1):
    τ ~ LogNormal(μ = log(r) − σ²/2, σ),  n = Poisson(τ) + 1.
    μ is chosen so that E[τ] = r, hence E[n] = r + 1."""
    mu = math.log(mean) - sigma**2 / 2
    tau = torch.exp(mu + sigma * torch.randn((), generator=generator, dtype=torch.float64))
    return int(torch.poisson(tau, generator=generator).item()) + 1


def check_args(name: str, mean: float, sigma: float, backprop_depth: int | None) -> None:
    """A sampler's settings, checked with one line naming the field each (`LoopSampler`
    checks itself with it; so does the run config's schema, recdepth/config/schema.py)."""
    if name not in SAMPLERS:
        raise ValueError(f"sampler.name: unknown sampler {name!r} (expected one of {', '.join(SAMPLERS)})")
    if not (isinstance(mean, (int, float)) and math.isfinite(mean) and mean >= 1):
        raise ValueError(f"sampler.mean: expected a number >= 1, got {mean!r}")
    if name == "fixed" and float(mean) != int(mean):
        raise ValueError(f"sampler.mean: the fixed sampler needs an integer loop count, got {mean!r}")
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sampler.sigma: expected a finite number >= 0, got {sigma!r}")
    if backprop_depth is not None and (isinstance(backprop_depth, bool) or not isinstance(backprop_depth, int)
                                       or backprop_depth < 1):
        raise ValueError(f"sampler.backprop_depth: expected an integer >= 1 or null, got {backprop_depth!r}")


class LoopSampler:
    """Draws one loop count per recurrence group per forward pass.

    name: `lognormal_poisson` (training, SPEC §1) or `fixed` (n = mean, every pass).
    mean: r, the mean recurrence (paper: 12).
    sigma: the lognormal's σ (paper/Huginn: 0.5).
    backprop_depth: k, applications per group that carry gradient (Huginn: 8); None = all.
    """

    def __init__(self, name: str, n_groups: int, mean: float, sigma: float = 0.5,
                 backprop_depth: int | None = 8, seed: int = 0):
        check_args(name, mean, sigma, backprop_depth)
        self.name, self.n_groups = name, n_groups
        self.mean, self.sigma, self.backprop_depth = float(mean), float(sigma), backprop_depth
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self) -> list[int]:
        """One loop count per group for the next forward pass."""
        if self.name == "fixed":
            return [int(self.mean)] * self.n_groups
        return [lognormal_poisson(self.mean, self.sigma, self.generator) for _ in range(self.n_groups)]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        # A generator's state is a CPU byte tensor; a checkpoint loaded with map_location=cuda
        # (evaluating on a GPU) hands it over on the GPU.
        self.generator.set_state(state["generator"].cpu())
