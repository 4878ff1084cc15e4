"""`recdepth lm-eval ...` (`python -m recdepth.harness ...`): EleutherAI's lm-evaluation-harness
command line with `--model recdepth` registered (recdepth/app/lm_eval.py: the model_args,
what each request type computes, and the applications per task in the results).

    recdepth lm-eval --model recdepth --model_args ckpt=<run>/train/checkpoints/last.ckpt,exit=accel,tau=1e-3 \\
        --tasks lambada_openai,hellaswag --batch_size 16 --output_path <dir>
    recdepth lm-eval --model recdepth --model_args hf=<huginn dir>,exit=kl,tau=5e-4 --tasks arc_easy

Every argument after `lm-eval` is lm_eval's own (`recdepth lm-eval --help` is its help);
standard tasks download their datasets from the Hugging Face hub, a local task
(`--include_path <dir>` with a task YAML over local files) needs no network. Needs the
optional extra: `pip install -e ".[eval]"`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    try:
        import lm_eval.__main__ as lm_eval_main

        import recdepth.app.lm_eval  # noqa: F401  (registers --model recdepth)
    except ImportError as e:
        raise SystemExit(f"recdepth lm-eval: lm-evaluation-harness is not installed (pip install -e \".[eval]\"): {e}") from None
    sys.argv = ["recdepth lm-eval", *(sys.argv[1:] if argv is None else argv)]
    lm_eval_main.cli_evaluate()


if __name__ == "__main__":
    main()
