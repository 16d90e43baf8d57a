"""A ~20B-parameter GPT profiles on a laptop-sized machine without allocating its weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter so that memory used by earlier tests cannot hide growth.
SCRIPT = r"""
import json, resource, time
import torch
import torch.nn.functional as F
from lightning_elixir.demos.gpt import GPT, GPTConfig
from lightning_elixir.profile.model import profile_model

config = GPTConfig(vocab_size=50257, block_size=1024, n_layer=24, n_head=64, n_embd=8192)
with torch.device("meta"):
    model = GPT(config)
tokens = torch.zeros(1, 1024, dtype=torch.long)

def step(module, batch):
    logits = module(batch[0])
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), batch[1].view(-1))

before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
profile = profile_model(model, (tokens, tokens), step_fn=step, compute_dtype=torch.bfloat16,
                        param_dtype=torch.bfloat16)
seconds = time.perf_counter() - start
after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"numel": profile.total_numel, "expected": sum(p.numel() for p in model.parameters()),
                  "grew_bytes": (after_kib - before_kib) * 1024, "seconds": seconds,
                  "accesses": len(profile.accesses), "blocks": config.n_layer,
                  "peak_bytes": profile.activation_peak_bytes}))
"""


def test_20b_gpt_profiles_without_allocating_its_weights():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"20B profile: {result}")
    assert 19e9 < result["numel"] == result["expected"] < 21e9
    assert result["grew_bytes"] < 1 << 30
    # wte, wpe, ln_f, lm_head and one unit per block, each forward once and backward once.
    assert result["accesses"] == 2 * (4 + result["blocks"])
    assert result["peak_bytes"] > 1024 * 8192 * 2  # at least one bf16 hidden state of the sequence
