#!/usr/bin/env bash
# One call on a CUDA machine (issue 32 items 2 and 4; at most about 9 minutes, a few on an H100): the torch
# pieces on the fused kernels (flash, memory-efficient) against the einsum rules, values and gradients, fp16 /
# bf16 / float32, causal, segment ids; JAX's pieces (cuDNN) the same; then peak memory and time per piece at
# S = 4k to 128k, each framework in its own process. No virtual environment: the repository on PYTHONPATH.
# Logs and JSON go to $OUT (attention/torch.json, attention/jax.json).
#   OUT=/tmp/out bash benchmarks/device_check_attention.sh
# CI runs the same Python on the CPU (--cpu --small, tests/test_attention_check.py); this script needs a GPU.
set -o pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/commlib-device}"
command -v nvidia-smi > /dev/null || { echo "device_check_attention.sh needs a machine with an NVIDIA GPU" >&2; exit 2; }
mkdir -p "$OUT/attention"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
} 2>&1 | tee "$OUT/attention/env.txt"
status=0
timeout 60 python3 -m pytest tests/torch/test_kernels.py -q -p no:cacheprovider 2>&1 | tee "$OUT/attention/test_kernels.log" | tail -3
timeout 240 python3 benchmarks/attention_check.py --framework torch --out "$OUT/attention" 2>&1 | tee "$OUT/attention/torch.log" || status=1
timeout 200 python3 benchmarks/attention_check.py --framework jax --out "$OUT/attention" 2>&1 | tee "$OUT/attention/jax.log" || status=1
exit $status
