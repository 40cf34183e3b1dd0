#!/usr/bin/env bash
# The GPU check harness on a CUDA machine (scripts/gpu_check.py; its arguments pass through); files go to $OUT.
# Optional: the real SmolLM2 file sent in two halves (gpu_parts/smol.00.part, smol.01.part) is reassembled and compared.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 OUT="${OUT:-gpu_out}"
# gguf-py and PyYAML (which it imports) copied into gpu_parts/pylib (git-ignored: name it in the device call's carry;
# cp -r .venv/lib/python3.11/site-packages/{gguf,yaml} gpu_parts/pylib/): the reference tests run instead of skipping
[ -d gpu_parts/pylib ] && export PYTHONPATH=src:gpu_parts/pylib
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$OUT/gpu_check.log"
real=()
if [ -f gpu_parts/smol.00.part ] && [ -f gpu_parts/smol.01.part ]; then
  cat gpu_parts/smol.00.part gpu_parts/smol.01.part > /tmp/smollm2.gguf && real=(--real /tmp/smollm2.gguf)
fi
python3 scripts/gpu_check.py --out "$OUT" "${real[@]}" "$@"
