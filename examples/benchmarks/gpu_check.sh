#!/usr/bin/env bash
# The one prepared GPU run, about 8 minutes on one H200 (at most 9.5: the time limits); it builds and installs nothing.
#   1. the GPU tests (tests/test_gpu.py);
#   2. the harness on one GPU: the GPT at GPT-2 medium size, bf16-mixed, one round of 5 timed steps.
#      At an emulated budget of 80 GB (everything fits): DDP, Elixir's auto plan and FSDP2.
#      At 16 GB, where the model's states and activations do not all fit: the auto plan, Elixir's
#      all-on-host plan, FSDP2 with CPU offload, DeepSpeed ZeRO-3 offload ("not installable" without
#      deepspeed) and DDP (expected to run out of memory; the row says so);
#   3. the offload benchmark's GPU table.
# Everything goes under $OUT (default gpu_results/): the machine, the test log, the harness's tables
# (.md), JSON and plots, the offload table. Each part has its own time limit, so a hang in one still
# leaves the others' results.
# Usage (CUDA, the project installed): bash examples/benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu_results}"
mkdir -p "$out"
export PYTHONPATH=.
{
  nvidia-smi
  python -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"
  python -c "import deepspeed; print('deepspeed', deepspeed.__version__)" || echo "deepspeed: not installable"
} > "$out/machine.txt" 2>&1
timeout 120 python -m pytest tests/test_gpu.py -q 2>&1 | tee "$out/gpu_tests.txt"
harness() {  # name, seconds, budget, systems; the .log has each run's step time as it finishes
  timeout "$2" python examples/benchmarks/harness.py --accelerator gpu --devices 1 --size medium --workloads gpt \
    --budgets "$3" --systems "$4" --rounds 1 --warmup 2 --steps 5 --run-timeout 75 \
    --json "$out/harness_$1.json" --png "$out/harness_$1.png" > "$out/harness_$1.md" 2> "$out/harness_$1.log"
  cat "$out/harness_$1.md"
}
harness fits 150 80GB ddp,elixir,fsdp2
harness offload 210 16GB elixir,elixir_offload,fsdp2_offload,deepspeed_zero3_offload,ddp
timeout 90 python examples/benchmarks/offload.py --gpu-only 2>&1 | tee "$out/offload_gpu.txt"
