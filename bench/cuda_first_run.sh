#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool): tests/gpu, a search on one GPU, then bench/cuda_first_run.py;
# logs and results land in $OUT. Wheels autotune needs beyond the machine's image (optuna and its own) travel in
# .whl (see /work/.library/device/README.md): carry it.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cuda_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; python3 -c 'import torch, optuna; print(torch.__version__, optuna.__version__)'; } > "$OUT/machine.txt" 2>&1
SECONDS=0
timeout "${GPU_TESTS_S:-150}" python3 -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/pytest_gpu.log" 2>&1
echo "tests/gpu rc=$? after ${SECONDS}s"
timeout "${SEARCH_S:-120}" python3 -m autotune search bench/models/gpt_cuda.py --gpus 1 --device cuda --trials 6 \
  --batch-size 32 -o "$OUT/gpt_cuda.yaml" --report-dir /tmp/report --storage sqlite:////tmp/study.db > "$OUT/search.log" 2>&1
echo "search rc=$? after ${SECONDS}s"
cp /tmp/report/report.md "$OUT/search_report.md" 2>/dev/null
timeout "${BENCH_S:-300}" python3 bench/cuda_first_run.py --out "$OUT" --budget-s "${BENCH_BUDGET_S:-180}" > "$OUT/bench.log" 2>&1
echo "bench rc=$? after ${SECONDS}s"
