#!/usr/bin/env bash
# One call on a CUDA machine (about 2 minutes on an H200): the pack tests, the layout benchmark (with its
# output check, the kernel's tile sweep and torch.compile for comparison), then the pack probe (device and
# host time of each way to run a pass). Logs and JSON go to $OUT.
#   OUT=/tmp/out bash benchmarks/device_check.sh
set -o pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/commlib-device}"
command -v nvidia-smi > /dev/null || { echo "device_check.sh needs a machine with an NVIDIA GPU" >&2; exit 2; }
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"
timeout 120 python3 -m pytest tests/torch/test_pack.py -q -p no:cacheprovider 2>&1 | tee "$OUT/test_pack.log" | tail -3
timeout 180 python3 benchmarks/layout.py --device cuda --check --sweep --inductor --json "$OUT/layout_cuda.json" \
  --markdown "$OUT/layout_cuda.md" 2>&1 | tee "$OUT/layout.log"
timeout 90 python3 benchmarks/pack_probe.py --json "$OUT/pack_probe.json" 2>&1 | tee "$OUT/pack_probe.log"
