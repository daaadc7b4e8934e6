#!/bin/bash
# The GPU checks of the speed work, in calls that fit a short lease, in two parts:
# - accuracy: the paper's Table 2 at both budgets (epsilon 2.79 and 10.18: 17 rounds, 3 seeds x 3 algorithms, nine
#   runs at once, each bound by its own host thread) while the CUDA tests run beside it;
# - timing, alone on the machine: the rounds of 5 clients at width 32 and the thousand-client federation with its
#   floor, both again with the DP query captured (FEDAUDIT_CUDA_GRAPHS=all; the federation also with 4 clients at
#   once instead of one), the DP step against Opacus, and a FedLAP-DP client round (its image steps as CUDA graphs
#   against eager, then a profiled one).
# Each step under its own time limit, never past the budget, everything logged to OUT/log.txt.
#
#   bash tools/gpu_checks.sh [OUT] [BUDGET_SECONDS] [accuracy|timing|all]
#
# Needs python3 with torch (CUDA), fedaudit installed (pip install --no-deps -e .), opacus, dp-accounting and
# cryptography, and Fashion-MNIST where fedaudit finds it (DEVELOPERS.md, "On a GPU").
set -u
OUT=${1:-gpu-results}
END=$((SECONDS + ${2:-540}))
mkdir -p "$OUT"
LOG=$OUT/log.txt
export PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS COMMAND...
  local name=$1 want=$2
  shift 2
  local left=$((END - SECONDS))
  local limit=$((want < left ? want : left))
  if [ "$limit" -lt 15 ]; then
    echo "=== $name skipped: no time left" | tee -a "$LOG"
    return
  fi
  echo "=== $name (at most ${limit}s) $(date +%T)" | tee -a "$LOG"
  local began=$SECONDS
  timeout -k 5 "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name: exit $? after $((SECONDS - began))s" | tee -a "$LOG"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$LOG"
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee -a "$LOG"
PART=${3:-all}
if [ "$PART" != timing ]; then
  echo "=== table2 (in the background, at most $((END - SECONDS - 10))s) $(date +%T)" | tee -a "$LOG"
  began=$SECONDS
  timeout -k 5 $((END - SECONDS - 10)) python3 benchmarks/table2.py --device cuda --jobs 9 --out /tmp/table2 \
    >"$OUT/table2.txt" 2>&1 &
  table2=$!
  step tests 240 python3 -m pytest tests/fedaudit/test_gpu.py -n 4 -q -p no:cacheprovider --durations=10
  wait "$table2"
  echo "=== table2: exit $? after $((SECONDS - began))s" | tee -a "$LOG"
  cat "$OUT/table2.txt" >>"$LOG"
fi
if [ "$PART" != accuracy ]; then
  step rounds_w32 80 python3 benchmarks/utility.py --device cuda --rounds 1 --width 32 --out /tmp/utility32
  step rounds_w32_all 80 env FEDAUDIT_CUDA_GRAPHS=all python3 benchmarks/utility.py --device cuda --rounds 1 \
    --width 32 --out /tmp/utility32-all
  step scale 130 python3 benchmarks/scale.py --device cuda --clients 1000 --rounds 20 --eval-every 10 \
    --sampled-only --floor
  step scale_all 100 env FEDAUDIT_CUDA_GRAPHS=all python3 benchmarks/scale.py --device cuda --clients 1000 \
    --rounds 20 --eval-every 10 --sampled-only
  # the host work of a client is Python: 4 clients at once on their own threads and streams (scale.py's default: 1)
  step scale_all_4 100 env FEDAUDIT_CUDA_GRAPHS=all python3 benchmarks/scale.py --device cuda --clients 1000 \
    --rounds 20 --eval-every 10 --sampled-only --parallel-clients 4
  step per_sample_grads 45 python3 benchmarks/per_sample_grads.py --device cuda --widths 32 128
  step fedlap_round 60 python3 benchmarks/fedlap_round.py --device cuda --widths 32
  step fedlap_round_profiled 120 python3 benchmarks/fedlap_round.py --device cuda --widths 32 --trajectories 1 \
    --profile "$OUT/profile.txt"
fi
echo "=== done $(date +%T), ${SECONDS}s" | tee -a "$LOG"
