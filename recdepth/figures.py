"""`python -m recdepth.figures <run_dir>`: the paper's loop-geometry figures, from the JSON.

Reads `<run_dir>/diagnostics/step_*.json` (written by the `LoopDynamics` callback) and
nothing else, and writes PNG and PDF files to `<run_dir>/figures/`:

  fig1_pca             Fig. 1: 2-D PCA trajectory of one held-out sequence at the last
                       checkpoint; PCA refit on the union of its states over depth and
                       loop steps; one polyline per token, colour light -> dark by
                       iteration; an inset zooms on one loop of one token.
  fig2_dlr             Fig. 2: drift-to-loop ratio (eq. 2) per group boundary across
                       checkpoints (mean over tokens, 1σ band; DLR = 1 dashed).
  fig3_loop_dynamics   Fig. 3: (a) step norms ‖Δ^(k)‖ and (b) step cosines
                       cos∠(Δ^(k), Δ^(k−1)), one panel per group, mean with 1σ band, one
                       curve per checkpoint; the first `fig3_steps` steps (default 16).
                       Dotted verticals (Figs. 3, 5): where a checkpoint's mean step
                       falls under 10x the dtype's rounding floor.
  fig5_cosines         Fig. 5: the full consecutive-step cosines over the fixed loops
                       (30 by default) across all checkpoints.

The training run draws them at its end; this command redraws them, e.g. after changing
a figure, or from a run that is still going.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recdepth.analysis.plots import FORMATS, draw_all


def main(argv=None) -> list[Path]:
    p = argparse.ArgumentParser(prog="python -m recdepth.figures", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a training run directory (holds diagnostics/step_*.json)")
    p.add_argument("--out", default=None, help="output directory (default: <run_dir>/figures)")
    p.add_argument("--fig3-steps", type=int, default=16, help="loop steps shown in Fig. 3 (default 16)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=["png", "pdf", "svg"])
    args = p.parse_args(argv)
    if args.fig3_steps < 2:
        p.error(f"--fig3-steps: expected >= 2, got {args.fig3_steps}")
    try:
        written = draw_all(args.run_dir, args.out, args.fig3_steps, tuple(args.formats))
    except (FileNotFoundError, ValueError) as e:
        p.exit(2, f"recdepth.figures: error: {e}\n")
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
