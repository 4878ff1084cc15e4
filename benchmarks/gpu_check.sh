#!/usr/bin/env bash
# benchmarks/gpu_check.sh: recdepth's GPU paths checked on one CUDA GPU in one run (CI has
# no GPU; a session lent one runs this; docs/results/gpu.md).
#
#   1. The paper shape (experiment=paper: d = 768, groups [[4],[5,6],[7]], r = 12,
#      truncated backprop 8) trains STEPS steps in bf16 on the shipped corpus, eagerly and
#      (last) under trainer.compile=true: step time, tokens/s and MFU from its CSV log, the
#      loss; the eval block after training decodes on the GPU.
#   2. That checkpoint scored by `recdepth evaluate` under exit=accel on the GPU (eval.backend
#      lean and compiled) and on the CPU (lean): CE, applications and ms/token side by side
#      (equal up to float rounding: a criterion within rounding of tau may move a token).
#   3. `recdepth bench decode --device cuda`: ms per layer application, module / lean /
#      compiled, batch 1 and 16, the default shape and the paper's.
#
# Usage (from the repository root): OUT=<dir> bash benchmarks/gpu_check.sh
#   STEPS (150), EVAL_TOKENS (512: one window of the paper's block), DEVICE (cuda), PYTHON (python3), EXTRA (more
#   overrides for every training run), BENCH (bench decode's arguments). A dry run on a
#   CPU: EXTRA="model.size=cpu trainer.accelerator=cpu trainer.precision=32-true" DEVICE=cpu
#   STEPS=4 EVAL_TOKENS=32 BENCH="--no-paper --batches 1 --rounds 1 --decode-reps 2".
# Writes under OUT: log.txt (everything), train_eager.json, train_compiled.json,
# eval_on_device_lean.json, eval_on_device_compiled.json, eval_on_cpu_lean.json (each
# run's metrics.json) and summary.txt.
set -uo pipefail
OUT=${OUT:-gpu_check}
STEPS=${STEPS:-150}
EVAL=${EVAL_TOKENS:-512}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
EXTRA=${EXTRA:-}
BENCH=${BENCH:---batches 1 16 --rounds 3 --decode-reps 10}
WORK=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline
exec > >(tee -a "$OUT/log.txt") 2>&1

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null)"
$PY -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available())"

# 1. training (eager first; compiled last, after the checks that need only a checkpoint)
train() {  # $1: eager | compiled
  local compile=false; [ "$1" = compiled ] && compile=true
  echo "== train ($1)"
  local start; start=$(date +%s)
  # shellcheck disable=SC2086
  timeout "$2" $PY -m recdepth train experiment=paper data=shakespeare trainer.max_steps="$STEPS" \
    trainer.val_check_interval="$STEPS" trainer.checkpoint_every="$STEPS" trainer.log_every_n_steps=10 \
    trainer.compile=$compile trainer.enable_progress_bar=false optim.warmup_steps=20 \
    eval.tokens="$EVAL" eval.latency_tokens=64 eval.repeats=1 \
    runs_dir="$WORK/runs_$1" hydra.run.dir="$WORK/train_$1" $EXTRA
  echo "== train ($1): exit $? after $(( $(date +%s) - start )) s"
  cp "$WORK/train_$1/metrics.json" "$OUT/train_$1.json"
}
train eager 240

# 2. the eager run's checkpoint scored on the GPU and on the CPU
ckpt=$(grep -h "training dir" "$WORK/train_eager/train.log" | sed 's/.*training dir //' | head -1)/checkpoints/last.ckpt
echo "== checkpoint $ckpt"
for run in "$DEVICE lean on_device_lean" "$DEVICE compiled on_device_compiled" "cpu lean on_cpu_lean"; do
  set -- $run
  echo "== evaluate on $1, eval.backend=$2"
  start=$(date +%s)
  timeout 240 $PY -m recdepth evaluate ckpt="$ckpt" device="$1" exit=accel eval.backend="$2" eval.tokens="$EVAL" \
    eval.latency_tokens=64 eval.repeats=1 hydra.run.dir="$WORK/eval_$3"
  echo "== evaluate on $1, eval.backend=$2: exit $? after $(( $(date +%s) - start )) s"
  cp "$WORK/eval_$3/metrics.json" "$OUT/eval_$3.json"
done

# 3. one layer application, module / lean / compiled
echo "== bench decode --device $DEVICE"
# shellcheck disable=SC2086
timeout 240 $PY -m recdepth bench decode --device "$DEVICE" $BENCH

train compiled 300

# the numbers side by side (training: medians over the second half of the logged steps)
$PY - "$OUT" <<'EOF' | tee "$OUT/summary.txt"
import csv, json, pathlib, statistics, sys
out = pathlib.Path(sys.argv[1])
for f in sorted(out.glob("*.json")):
    m = json.loads(f.read_text())
    row = {k: m[k] for k in ("val_ce", "train_seconds", "steps", "tokens_seen") if k in m}
    log = pathlib.Path(m.get("train_dir", "-")) / "csv" / "metrics.csv"
    if log.exists():
        rows = list(csv.DictReader(log.open()))
        for key in ("perf/step_ms", "perf/tokens_per_sec", "perf/mfu"):
            v = [float(r[key]) for r in rows if r.get(key)]
            row[key] = statistics.median(v[len(v) // 2:]) if v else None
    ev = m.get("eval") or {}
    row.update({f"eval.{k}": ev.get(k) for k in ("ce", "applications_per_token", "ms_per_token", "tokens_per_s",
                                                  "batch_check", "backend") if k in ev})
    print(f.stem, json.dumps(row))
EOF
