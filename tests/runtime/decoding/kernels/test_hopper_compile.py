"""The sampling kernels compile for Hopper (sm_90) on the CPU, through Triton's own compiler down to PTX.

Triton's interpreter runs a kernel as Python, so it accepts what the compiler refuses: a name bound to tensors of
two shapes across an if's branches or a loop's iterations, say. Such a kernel passes every interpreted test and
fails on the first GPU call (2026-12-06: the sampler's tie path, 54 GPU tests). Compiling here catches that
class; the kernels' values are the interpreted tests' business. The compile runs in a child process: this one
has TRITON_INTERPRET set (tests/conftest.py), under which @triton.jit makes interpreted functions.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

COMPILE = r'''
import sys
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from xcompile.runtime.decoding.kernels import accept_sampled, accept_sampled_tree, sample

if "nvidia" not in backends:
    sys.exit(3)
POINTERS = {**dict.fromkeys(("T", "TOP_P", "MIN_P", "PV", "PN", "Q", "QTOK", "ST"), "*fp32"),
            **dict.fromkeys(("KEY", "CNT", "OUT", "TGT", "TOK", "COUNT", "T2D", "PAR", "DEP", "PATH"), "*i64"),
            "PI": "*i32", "X": "*bf16", "MASK": "*u8"}
TILE = dict(KP2=64, PDL=False)                              # 151,936 columns: 38 blocks of 4,096
KERNELS = [
    (sample._sample_blocks_kernel, dict(TILE, BLOCK=4096, HAS_Q=True)),
    (sample._sample_rows_kernel, dict(TILE, NBP2=64, TOPP=True, BLOCK=4096, HAS_Q=False, HAS_T=False)),
    (sample._sample_rows_kernel, dict(TILE, NBP2=64, TOPP=True, BLOCK=4096, HAS_Q=True, HAS_T=True)),
    (accept_sampled._warp_rows_kernel, dict(TILE, NBP2=64, TOPP=True)),
    (accept_sampled._chain_kernel, dict(TILE, NBP2=64, BLOCK=4096, HAS_Q=True, HAS_T2D=True)),
    (accept_sampled_tree._tree_kernel, dict(TILE, NBP2=64, BLOCK=4096, SP2=32, DP2=8)),
]
for kernel, constexprs in KERNELS:
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in kernel.arg_names}
    try:
        ptx = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        print(kernel.__name__, "ok" if ".target sm_90" in ptx else "no sm_90 target in the PTX")
    except Exception as e:
        print(kernel.__name__, "FAILED:", " ".join(str(e).split())[-600:])
'''


def test_sampling_kernels_compile_for_hopper(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)                     # a real compile, not a cached one
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=900)
    if run.returncode == 3:
        pytest.skip("this Triton has no NVIDIA backend to compile with")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 6 and all(line.endswith(" ok") for line in lines), run.stdout
