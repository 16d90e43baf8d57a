#!/usr/bin/env bash
# The one prepared GPU run: GPU tests, the strategies benchmark on one device, then the offload
# benchmark's GPU table (plan="auto" with offload, all chunks on "cpu", FSDP2 CPU offload). Builds nothing.
# Usage (on a machine with CUDA and the project installed): bash examples/benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
timeout 150 python -m pytest tests/test_gpu.py -q 2>&1 | tee "$out/gpu_tests.txt"
timeout 150 python examples/benchmarks/strategies.py --accelerator gpu --devices 1 --precision bf16-mixed \
  --n-layer 12 --n-embd 768 --n-head 12 --vocab-size 50304 --block-size 1024 --batch-size 8 --steps 20 \
  2>&1 | tee "$out/strategies_gpu.txt"
timeout 150 python examples/benchmarks/offload.py --gpu-only 2>&1 | tee "$out/offload_gpu.txt"
