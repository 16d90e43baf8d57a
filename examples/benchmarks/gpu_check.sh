#!/usr/bin/env bash
# The prepared GPU run on one H200; it builds and installs nothing from source. Four parts, each with its
# own time limit (a hang in one still leaves the others' results):
#   tests    the GPU tests (tests/test_gpu.py), 1-2 minutes (most of it inductor compiling one test's blocks);
#   fits     the harness with the GPT at GPT-2 medium size, bf16-mixed, one round of 5 timed steps, at an
#            emulated budget of 80 GB where everything fits: Elixir's auto, ZeRO-2 and ZeRO-3 plans, DDP,
#            FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, and Lightning's FSDP (about 40 s a system);
#   offload  the same at 16 GB, where the model's states and activations do not all fit (the planner
#            predicts 18.5 GiB for the all-device plan): the auto plan, Elixir's all-on-host plan, FSDP2
#            with CPU offload, DeepSpeed ZeRO-3 offload, and DDP (expected to run out of memory);
#   table    the offload benchmark's GPU table, then its host tables: the host's AdamW, and the thread that
#            launches kernels beside the offload worker at both thread counts (not run by default);
#   budgets  plan="auto" at tight budgets (not run by default; about 4 minutes): the GPT at 16, 20, 24
#            and 32 GB and the Llama workload at 20 GB; every run must complete (a step that runs out of
#            memory is recovered and logged), the table's peak against the plan's predicted peak in the logs;
#   tight    recomputation and offload chosen together (not run by default; about 7 minutes): the GPT at
#            16 GB and the Llama workload at 20 GB, auto against the all-on-host plan and the peers with
#            activation checkpointing by hand ("+ac": DDP, FSDP2) and FSDP2 with CPU offload;
#   host     the host cost of the step protocol (not run by default; about 7 minutes): the 80 GB
#            comparison of DDP, Elixir's ZeRO-2, ZeRO-3 and auto plans and FSDP2 (on one GPU the ZeRO-3
#            preset keeps every chunk gathered, as ZeRO-2 does: [Note: a world of one]), then DDP and the auto
#            plan with every block compiled ("+compile"), then torch.profiler's table of the hooks of
#            ZeRO-2 (3 steps).
# Usage (CUDA; the project importable from the repository root):
#   bash examples/benchmarks/gpu_check.sh                 # tests, fits, offload: about 10 minutes
#   bash examples/benchmarks/gpu_check.sh tests fits      # some parts, in the order given
# On the first H200 run (BENCHMARKS.md) "tests fits" and "offload" ran as two calls of 4-5 minutes each.
# Wheels in .whl/ (DeepSpeed and what it needs, where the machine lacks them) are installed into
# /tmp/site first; DeepSpeed's host Adam is compiled in the background while the first parts run. The
# wheels for an x86-64 Python 3.12 machine, made here (DeepSpeed's sdist built without its extensions):
#   pip download --no-deps deepspeed==0.19.8 -d /tmp/ds && DS_BUILD_OPS=0 pip wheel --no-deps \
#     --no-build-isolation /tmp/ds/deepspeed-0.19.8.tar.gz -w .whl     # needs torch installed
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl hjson pydantic pydantic-core==2.50.5 annotated-types \
#     typing-inspection typing_extensions                              # pydantic-core: the one pydantic pins
# Every harness run's rank logs (the plan Elixir chose, its self-correction, any error in full) go
# to gpu_results/logs/, and the hardware profile plan="auto" measured to gpu_results/ (to compare with
# the estimate in configs/hardware/h200-x1.json).
# Results: gpu_results/ (the machine, the test log, the harness's tables (.md), logs, JSON and plots, the
# offload table); where $OUT is set, all of them also as one $OUT/gpu_check.tar, refreshed after each part.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=gpu_results
mkdir -p "$out"
py=$(command -v python3 || command -v python)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
pack() { if [ -n "${OUT:-}" ]; then tar -cf "$OUT/gpu_check.tar" "$out"; fi; }

if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  date -u
  nvidia-smi
  lscpu | grep -E "Model name|^CPU\(s\)"
  free -g | head -2
  "$py" -c "import sys, torch, lightning; print('python', sys.version.split()[0], 'torch', torch.__version__, 'lightning', lightning.__version__)"
  "$py" -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
} > "$out/machine.txt" 2>&1
cat "$out/machine.txt"
( timeout 240 "$py" -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam built')" \
  > "$out/deepspeed_build.txt" 2>&1 ) &
build=$!
pack

harness() {  # name, seconds, budget, systems[, workload]; the .log has each run's step time as it finishes
  timeout "$2" "$py" examples/benchmarks/harness.py --accelerator gpu --devices 1 --size medium --workloads "${5:-gpt}" \
    --budgets "$3" --systems "$4" --rounds 1 --warmup 2 --steps 5 --run-timeout 90 --logs "$out/logs" \
    --json "$out/harness_$1.json" --png "$out/harness_$1.png" > "$out/harness_$1.md" 2> "$out/harness_$1.log"
  cat "$out/harness_$1.log" "$out/harness_$1.md"
}
for part in ${*:-tests fits offload}; do
  echo "=== $part $(date -u +%T)"
  case "$part" in
    tests) timeout 240 "$py" -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" ;;
    fits) harness fits 360 80GB elixir,elixir_zero2,elixir_zero3,ddp,fsdp2,deepspeed_zero2,deepspeed_zero3,fsdp ;;
    offload) harness offload 300 16GB elixir,elixir_offload,fsdp2_offload,ddp,deepspeed_zero3_offload ;;
    budgets)
      harness budgets_gpt 200 16GB,20GB,24GB,32GB elixir
      harness budgets_llama 60 20GB elixir llama ;;
    tight)
      harness tight_gpt 230 16GB elixir,elixir_offload,ddp+ac,fsdp2+ac,fsdp2_offload
      harness tight_llama 230 20GB elixir,elixir_offload,ddp+ac,fsdp2+ac,fsdp2_offload llama ;;
    table)
      timeout 120 "$py" examples/benchmarks/offload.py --gpu-only 2>&1 | tee "$out/offload_gpu.txt"
      timeout 90 "$py" examples/benchmarks/offload.py --host-only 2>&1 | tee "$out/offload_host.txt" ;;
    host)
      harness host 300 80GB ddp,elixir_zero2,elixir,elixir_zero3,fsdp2
      harness host_compile 200 80GB ddp+compile,elixir+compile
      timeout 100 "$py" examples/benchmarks/harness.py --accelerator gpu --devices 1 --size medium --workloads gpt \
        --budgets 80GB --profile elixir_zero2 --warmup 2 --profile-steps 3 --run-timeout 90 \
        > "$out/hooks_profile.md" 2>&1; cat "$out/hooks_profile.md" ;;
    *) echo "unknown part $part (tests, fits, offload, budgets, tight, table, host)" ;;
  esac
  cp ~/.cache/lightning_elixir/*.json "$out/" 2> /dev/null  # the hardware profile plan="auto" measured
  pack
done
kill "$build" 2> /dev/null; wait
tail -3 "$out/deepspeed_build.txt"
pack
