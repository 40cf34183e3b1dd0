#!/usr/bin/env bash
# The GPU check harness on a CUDA machine (scripts/gpu_check.py; its arguments pass through); files go to $OUT.
# Optional, each a git-ignored path to name in the device call's carry:
#  - gpu_parts/smol.00.part and smol.01.part, the real SmolLM2 file in two halves (two consecutive runs: the first
#    half stays on the warm machine): reassembled and compared;
#  - gpu_parts/pylib: gguf-py (`cp -r .venv/lib/python3.*/site-packages/gguf gpu_parts/pylib/`), so the reference
#    tests run instead of skipping;
#  - .gpu_tree/old/src: an older commit's source (`git archive COMMIT src | tar -x -C .gpu_tree/old`), whose
#    single-stream decode is measured side by side (--old).
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OUT="${OUT:-gpu_out}"
[ -d gpu_parts/pylib ] && export PYTHONPATH=$PYTHONPATH:gpu_parts/pylib
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv | tee -a "$OUT/gpu_check.log"
extra=()
if [ -f gpu_parts/smol.00.part ] && [ -f gpu_parts/smol.01.part ]; then
  cat gpu_parts/smol.00.part gpu_parts/smol.01.part > /tmp/smollm2.gguf && extra+=(--real /tmp/smollm2.gguf)
fi
[ -d .gpu_tree/old/src ] && extra+=(--old .gpu_tree/old/src)
python3 scripts/gpu_check.py --out "$OUT" "${extra[@]}" "$@"
