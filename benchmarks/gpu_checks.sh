#!/usr/bin/env bash
# The GPU checks of issue 16 in one script (about 10 minutes on one H200, most of it start-up):
# the CUDA tests, then benchmarks/gpu_layer.py at both model shapes, all experts (--ep 1) and
# one rank of 64-way expert parallelism (--ep 64). Results go to $OUT (default gpu_results/):
# pytest_cuda.txt, gpu_layer_ep1.json/.txt, gpu_layer_ep64.json/.txt, env.txt.
#
#     bash benchmarks/gpu_checks.sh            # from the repository root, venv in .venv
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
status=0

{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== CUDA tests"
timeout 240 "$PY" -m pytest -q -rxXs tests/layer/test_cuda.py tests/benchmarks/test_gpu_layer.py 2>&1 \
    | tee "$OUT/pytest_cuda.txt" | tail -25 || status=1

for ep in 1 64; do
  echo "== gpu_layer.py --ep $ep"
  timeout 180 "$PY" benchmarks/gpu_layer.py --ep "$ep" --repeats 10 --out "$OUT/gpu_layer_ep$ep.json" 2>&1 \
      | tee "$OUT/gpu_layer_ep$ep.txt" || status=1
done
exit $status
