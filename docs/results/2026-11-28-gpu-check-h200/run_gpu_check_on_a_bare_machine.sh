#!/bin/bash
# On a bare GPU machine, from the checkout: bash .whl/gpu.sh SECONDS [gpu-check arguments]; results in $OUT.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONDONTWRITEBYTECODE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
date -u | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 | tee -a "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 || { echo "wheels failed"; exit 3; }
if [ ! -d .git ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . >/dev/null 2>&1 || { echo "checkout install failed"; exit 3; }
fi
export PYTHONPATH=/tmp/site
python3 -c "import torch, transformers, accelerate, hydra; print('python3', __import__('sys').version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'from', transformers.__file__, 'accelerate', accelerate.__version__)" 2>&1 | tee -a "$OUT/env.txt"
lscpu | grep 'Model name' | tee -a "$OUT/env.txt"
timeout -k 15 -s INT "$1" python3 -m pipeline gpu-check --out /tmp/gc "${@:2}" 2>&1 | tee "$OUT/gpu-check.log"
rc=${PIPESTATUS[0]}
for f in /tmp/gc/*/gpu-check.json /tmp/gc/*/report.md; do [ -f "$f" ] && cp "$f" "$OUT/"; done
echo "gpu-check rc=$rc"
exit "$rc"
