#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool), ~7 min: tests/gpu; a Llama-8B-shaped model (bench/models/llama8b.py)
# profiled on one GPU block by block and planned for 8 (issue 29; LLAMA_S=0 skips it); a search on one GPU
# (SEARCH_MODEL, SEARCH_BATCH); bench/cuda_first_run.py (BENCH_ARGS: more of its options).
# Results land in $OUT (8 files: the device tool returns no more). Wheels autotune needs beyond the machine's image
# (optuna and its own) travel in .whl (see /work/.library/device/README.md): carry it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc;
  python3 -c 'import torch, optuna; print(torch.__version__, optuna.__version__)'; } > "$OUT/machine.txt" 2>&1
SECONDS=0
timeout "${GPU_TESTS_S:-120}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu.log" 2>&1
echo "tests/gpu rc=$? after ${SECONDS}s" | tee -a "$OUT/machine.txt"
if [ "${LLAMA_S:-150}" != 0 ]; then
  { timeout "${LLAMA_S:-150}" python3 -m autotune profile bench/models/llama8b.py --batch-size 8 --device cuda \
      --precision bf16 -o "$OUT/llama8b_profile.json" &&
    python3 -m autotune plan --profile "$OUT/llama8b_profile.json" --gpus 8 --memory-limit 75GiB --top 10; } \
    > "$OUT/llama8b.log" 2>&1
  echo "llama8b rc=$? after ${SECONDS}s" | tee -a "$OUT/machine.txt"
fi
# SEARCH_MODEL / SEARCH_BATCH: the model file a user searches on one GPU (default the GPU-sized GPT).
search_model=${SEARCH_MODEL:-bench/models/gpt_cuda.py}
timeout "${SEARCH_S:-100}" python3 -m autotune search "$search_model" --gpus 1 --device cuda --trials 6 \
  --batch-size "${SEARCH_BATCH:-32}" -o "$OUT/search.yaml" --report-dir /tmp/report --storage sqlite:////tmp/study.db \
  > "$OUT/search.log" 2>&1
echo "search $search_model rc=$? after ${SECONDS}s" | tee -a "$OUT/machine.txt"
cp /tmp/report/report.md "$OUT/search_report.md" 2>/dev/null
timeout "${BENCH_S:-240}" python3 bench/cuda_first_run.py --out "$OUT" --budget-s "${BENCH_BUDGET_S:-150}" ${BENCH_ARGS:-} > /tmp/bench.log 2>&1
echo "bench rc=$? after ${SECONDS}s" | tee -a "$OUT/machine.txt"
tail -5 /tmp/bench.log >> "$OUT/machine.txt"
