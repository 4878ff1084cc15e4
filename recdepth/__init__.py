"""recdepth: recurrent-depth ("looped") GPT-2 — training, loop geometry, early exit.

Where things are, in three layers, one folder each: recdepth/core/, recdepth/glue/ and the
commands at the top of recdepth/ (`python -m recdepth.<command>`). Imports point down only
(commands -> glue -> core), with no cycle, function-local imports included
(tests/test_layers.py reads the folders and keeps it so).

Core (recdepth/core/): the math, torch and numpy only
  core/model_config.py  the model's configuration: size presets, GPTConfig (a docstring per
                        field) and its checks (shape, recurrence groups, Huginn's options)
  core/model.py         the looped GPT-2 (recurrence groups, adapters, truncated backprop,
                        Huginn's architecture options: rope, gated MLP, q/k bias, latent norm)
  core/geometry.py      loop-geometry quantities (step norms, cosines, accelerations, DLR)
  core/sampler.py       loop-count samplers (lognormal-Poisson for training, fixed)
  core/gate.py          the learned exit gate: labels, logistic fit, the gate's probability, and
                        the parallel pass's states and depth-wise losses (SPEC §3c)
  core/exits.py         early-exit rules (the gate's too) and the reference `iterate` loop
  core/exit_step.py     an exit rule's check over tensors, for a loop compiled whole (the
                        compiled step's batch-1 loop, torch.while_loop)
  core/kv_cache.py      the K/V caches of decoding: one entry per position ("latest") or per
                        application ("per_step"), each row owning its entries
  core/state_decode.py  what the decoding rules decode a loop state with: the LM head, or
                        Huginn's coda reading the cache without writing it (exit.decode)
  core/decoding.py      the decoding engine: token by token with a KV cache under an exit
                        rule, batched exactly (per-row noise keys): decode_step, decode_windows
  core/mixed_settings.py several exit settings in one batch, each row under its own (a sweep)
  core/scoring.py       held-out text scored under exit rules with the engine: evaluate_exit(s)
                        (quality, cost, batch-1 latency), task answers, the oracle bound
  core/lean_step.py     the lean decode step: one token's layers in static shapes, eager or
                        torch.compile'd (eval.step); compiled at batch 1, a group's whole loop
                        as one graph; the oracle's rows reading their shared history once
  core/gate_states.py   the learned gate's data from the states the decoding engine visits
  core/calibration.py   the search that calibrates an exit rule per group to a CE-increase or
                        application target (real decodes of a calibration split)
  core/ltt.py           calibration with a guarantee (Learn then Test): per-window losses,
                        Hoeffding–Bentkus and binomial p-values, fixed-sequence testing, the staircase
  core/generation.py    generation under an exit rule: greedy token by token with a per-token
                        record of depth, and self-speculative decoding (draft at few
                        applications, verify in one chunk pass), exactly greedy's tokens
  core/stats.py         exit statistics from per-token records: fixed-depth frontier, oracle
                        saving, paired bootstrap CIs, Holm
  core/diagnostics.py   loop geometry of a model at fixed loops (capture, statistics, PCA)
  core/runtime.py       allocator tuning, peak FLOP/s
  core/tasks.py         algorithmic tasks with known per-token difficulty (hops, addition, modsum):
                        generators, disjoint splits, records with labels, answer scoring

Glue (recdepth/glue/): Lightning, Hydra config, data, files, figures
  glue/tokenizer.py     GPT-2 BPE, offline
  glue/documents.py     document sources (Shakespeare, FineWeb, local files) read with `datasets`
  glue/tokens.py        tokenizing with `Dataset.map` into the token cache (uint16 memmaps)
  glue/vocab.py         the model's vocabulary over GPT-2's (compact maps, unigram prior)
  glue/windows.py       window batches, the training order, the resumable train loader
  glue/data.py          the LightningDataModule
  glue/lit.py           the LightningModule (optimiser, schedule, metrics, throughput)
  glue/callbacks.py     LoopDynamics: diagnostics at every checkpoint, to JSON and loggers
  glue/plots.py         the paper's Figs. 1, 2, 3, 5 drawn from diagnostics records, Fig. 4 from
                        a sweep's rows
  glue/frontier_grid.py one frontier's grid and its settings, for make frontier and the report
  glue/frontier.py      a sweep's job rows, its tables (sweep_results, frontier) and the
                        frontier statistics (SPEC §4b: bootstrap over windows, verdicts, Holm)
  glue/task_tables.py   a task's sweep by difficulty (accuracy per difficulty and depth)
  glue/distributed.py   DDP ranks started by rank 0 (`python -m recdepth.train --ddp-rank`)
  glue/schema.py        the config schema: a root per command over the groups, registered
                        with Hydra; `validated(cfg)` checks a run's config
  glue/schema_groups.py one dataclass per conf/ group of what a run computes (model, sampler,
                        exit, data, eval), every key typed, documented and range-checked
  glue/schema_training.py the groups of how training runs and logs (trainer, optim, logger,
                        callbacks); both re-exported by schema.py
  glue/runs.py          run bookkeeping: training identity, the training dir it names, locks, resume
  glue/config.py        where conf/ is, and the objects built from the validated config
  glue/cli.py           the entry points' runner: job directory, refusal, config.yaml, the Hydra
                        main, argv forms, one-line errors, multirun jobs that fail without
                        stopping the sweep
  glue/hf.py            Huginn checkpoints in the Hugging Face format (config.json + safetensors
                        shards): load_hf / save_hf, names and config keys of docs/spec.md §1b
  glue/checkpoints.py   opening a trained model (a training checkpoint), its held-out tokens
  glue/token_files.py   eval_tokens.csv written and read back, the oracle's NLL as .npy
  glue/evaluation.py    scoring a checkpoint for the commands: eval settings, the shared decode
                        of a sweep's settings, eval_tokens.csv, the eval block after training
  glue/calibrating.py   calibrating a rule on a checkpoint: the test / calibration splits,
                        CalibrationSplit, the search and LTT driven on it, the test check
  glue/prompts.py       text in and out for generation: codecs (GPT-2 BPE into the compact
                        vocabulary, tokenizer.json), prompts, streaming to stdout
  glue/depth_view.py    a generation's depth as files: tokens.csv, depth.html, depth.png
  glue/harness.py       `--model recdepth` for EleutherAI's lm-evaluation-harness (the [eval]
                        extra): loglikelihood, rolling, generate_until under an exit rule

Commands (recdepth/*.py): what a user runs
  commands.py           `recdepth <command> ...` (the console script; __main__.py: `python -m
                        recdepth ...`): every entry point below behind one front door
  train.py              `python -m recdepth.train` (Hydra entry point; `train(cfg)` returns metrics)
  evaluate.py           `python -m recdepth.evaluate ckpt=...` (a checkpoint under an exit rule)
  train_gate.py         `python -m recdepth.train_gate ckpt=...` (fit a checkpoint's exit gate: gate.pt)
  calibrate.py          `python -m recdepth.calibrate ckpt=... exit=... target.max_ce_increase=...`
                        (per-group thresholds on a calibration split, then one test evaluation)
  report.py             `python -m recdepth.report ckpt=...` (every exit rule on one frontier:
                        calibrated rules, then the grid and the calibrated answers scored as
                        evaluate jobs of one frontier sweep; table + figure)
  diagnose.py           `python -m recdepth.diagnose ckpt=...` (the loop geometry of one model:
                        diagnostics JSON, Figs. 1, 2, 3, 5)
  generate.py           `python -m recdepth.generate ckpt=... prompt=...` (greedy or self-speculative
                        generation; tokens.csv, generation.json, depth.html, depth.png)
  figures.py            `python -m recdepth.figures <run_dir>` (redraw a run's figures)
  harness.py            `recdepth lm-eval ...`: lm_eval's command line with --model recdepth
  sweep.py              SweepSummary: the Hydra callback that aggregates a multirun
                        (`summarize`: tables, frontier.csv, Fig. 4, W&B table)
  bench.py              `python -m recdepth.bench` (throughput / MFU, exit kernels, callback overhead)
  bench_decode.py       `python -m recdepth.bench decode` (ms per layer application by eval.step,
                        against the arithmetic lower bound)
  bench_speculative.py  `bench speculative`: self-speculative against greedy decoding
  bench_sweeps.py       `bench ltt|intervals|settings`: LTT's coverage, a sweep's verdicts under
                        older statistics, a frontier grid decoded one by one and as one batch
"""

__version__ = "0.1.0"
