"""On a GPU: every compiled Triton kernel against its torch reference at serving shapes
(tokstream.kernels.check), and greedy tokens on CUDA equal to the CPU path's
(scripts/device_parity.py: Triton kernels with and without CUDA graphs, torch on the device).
Skipped without CUDA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]


def test_every_kernel_matches_its_reference_on_the_gpu():
    from tokstream.kernels import check

    results = check.run("cuda")
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]


@pytest.mark.timeout(660)
def test_cuda_greedy_tokens_equal_the_cpu_path():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "device_parity.py"), "cuda"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
