"""The GPU benchmark scripts refuse what their cache cannot hold before they touch a GPU: a clear one-line
error naming --max-seq-len, a non-zero exit, no traceback (so they run here, on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script,args,said", [
    ("fast_decode.py", ["--contexts", "128,4096", "--max-seq-len", "512"],
     "--max-seq-len 512 holds no 32-token step at context 4096"),
    ("step_timeline.py", ["--contexts", "128", "--tokens", "1,32", "--max-seq-len", "150"],
     "--max-seq-len 150 is shorter than the longest step's end (160)"),
])
def test_a_cache_too_small_for_the_contexts_is_refused(script, args, said):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=BENCHMARKS, env=env,
                         timeout=120)
    assert run.returncode != 0
    assert said in run.stderr and "Traceback" not in run.stderr, run.stderr
