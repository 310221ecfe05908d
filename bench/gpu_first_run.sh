#!/usr/bin/env bash
# The first lent GPU, before `make gpu-check` existed: every requires_gpu test, real NVML
# through the CLI, the demo and the GPU benches, each part under its own time limit, logs
# written as they go to $OUT (or ./gpu-first-run/). Usage: bash bench/gpu_first_run.sh
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu-first-run}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PY:-python3}"
part() {  # part LIMIT_S LOG TITLE CMD...
  local limit=$1 log=$2 title=$3; shift 3
  local t0=$SECONDS
  echo "=== $title (limit ${limit}s): $*" >>"$OUT/$log"
  timeout -k 5 "$limit" "$@" >>"$OUT/$log" 2>&1
  local rc=$?
  echo "=== $title: rc=$rc in $((SECONDS - t0))s" | tee -a "$OUT/$log" >>"$OUT/summary.txt"
}
{
  date -u; nvidia-smi; "$PY" --version
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")'
  "$PY" -m pip list 2>/dev/null | grep -iE "^(torch|accelerate|lightning|transformers|nvidia-ml-py|psutil|filelock|rich|click|numpy|safetensors|pytest|pytest-timeout|scikit-learn|tensorboard) "
} >"$OUT/env.txt" 2>&1
part 200 tests.log "requires_gpu tests" "$PY" -m pytest tests -m "requires_gpu or requires_gpus" -p no:cacheprovider \
  --continue-on-collection-errors -q -rA --timeout 90 --junitxml="$OUT/junit.xml"
part 30 cli.log "nvidia-smi query" nvidia-smi --query-gpu=index,uuid,name,pci.bus_id,memory.total,memory.used,memory.free,utilization.gpu,temperature.gpu,power.draw,power.limit,pcie.link.gen.current,pcie.link.width.current --format=csv
part 30 cli.log "gpukit ls --json" "$PY" -m gpukit ls --json
part 30 cli.log "gpukit ls" "$PY" -m gpukit ls
part 30 cli.log "gpukit select" "$PY" -m gpukit select
part 60 cli.log "gpukit doctor" "$PY" -m gpukit doctor
part 90 cli.log "gpukit demo" "$PY" -m gpukit demo
part 50 bench.log "overhead" "$PY" bench/overhead.py --steps 200 --warmup 20
part 60 bench.log "memory" "$PY" bench/memory.py --gpu-only
part 60 bench.log "planner (GPU rows)" "$PY" bench/planner.py --gpu-only
part 40 bench.log "dataloader" "$PY" bench/dataloader.py --seconds 2 --rounds 1 --tune-budget 3
part 25 bench.log "devices" "$PY" bench/devices.py --runs 5
# what time is left: the CPU suite with a GPU visible (paths that change when CUDA is available)
left=$((500 - SECONDS))
if [ "$left" -gt 30 ]; then
  part "$left" suite.log "whole suite, GPU visible" "$PY" -m pytest tests -p no:cacheprovider -q -rfE --timeout 120 \
    -n 12 -m "not requires_gpu and not requires_gpus" --continue-on-collection-errors
fi
echo "done in ${SECONDS}s" >>"$OUT/summary.txt"
