#!/usr/bin/env bash
# The one prepared GPU run: GPU tests, then the strategies benchmark on one device. Builds nothing.
# Usage (on a machine with CUDA and the project installed): bash examples/benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout 240 python -m pytest tests/test_gpu.py -q 2>&1 | tee "$out/gpu_tests.txt"
timeout 240 python examples/benchmarks/strategies.py --accelerator gpu --devices 1 --precision bf16-mixed \
  --n-layer 12 --n-embd 768 --n-head 12 --vocab-size 50304 --block-size 1024 --batch-size 8 --steps 20 \
  2>&1 | tee "$out/strategies_gpu.txt"
