"""Compile every fused kernel the tests launch for sm_90 (the H200) with the installed triton, no GPU needed.

    python scripts/compile_sm90.py [--tests-python PY] [--resources NAME] [PYTEST ARGS]
                                              # default: the kernel tests

The interpreter (how CI runs the kernels) and a newer triton accept code that the GPU image's triton
refuses; twice such a kernel first failed on the device (CHANGELOG.md, the eighth and ninth H200 sessions).
This runs the tests in Triton's interpreter in a subprocess, records each launch (the kernel, its
arguments' types, its constexprs, num_warps / num_stages), then compiles every distinct launch for
GPUTarget("cuda", 90, 32) as the GPU would run it: programmatic dependent launch on (PDL=True) and, for
kernels with an IEEE switch, tl.dot in the inputs' precision (IEEE=False) as well as in fp32. Arguments
are specialised as triton's launcher does (integers equal to 1 as constants; 16-byte-aligned tensors and
integers divisible by 16 marked so, which sets the loads' vector width). --resources NAME prints, for
each compiled launch of a kernel whose name contains NAME, ptxas's registers and spills, its shared
memory and how many of its programs fit an SM by registers (the occupancy that decides whether a grid
runs in one wave). Prints one line per
kernel and every failure; exit status 1 if one failed. To check against the GPU image's triton, run it
with a python holding that version, and the tests with the project's (--tests-python .venv/bin/python:
an older triton's interpreter may not run with this machine's numpy); DEVELOPERS.md, "Before a device call".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64",
          "torch.int64": "i64", "torch.int32": "i32", "torch.int16": "i16", "torch.int8": "i8",
          "torch.uint8": "u8", "torch.bool": "i1"}

# Loaded by the interpreted pytest run (-p): records launches into $XC_COMPILE_RECORD.
RECORDER = '''
import json, os, inspect
import torch
from triton.runtime import interpreter

_seen, _out = set(), open(os.environ["XC_COMPILE_RECORD"], "a")
_run = interpreter.InterpretedFunction.run

def _kind(v):
    if type(v).__name__ == "TensorDescriptor":
        return ["tensordesc", str(v.base.dtype), list(v.block_shape)]
    if isinstance(v, torch.Tensor):
        return ["tensor", str(v.dtype), v.data_ptr() % 16 == 0]
    if isinstance(v, bool) or v is None:
        return ["const", v]
    if isinstance(v, int):
        return ["int", v]
    if isinstance(v, float):
        return ["float", v]
    return ["const", repr(v)]

def run(self, *args, grid, warmup, **kwargs):
    fn = self.fn
    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
    kwargs.pop("launch_pdl", None)
    bound.update(kwargs)
    for p in params:
        if p.name not in bound and p.default is not inspect.Parameter.empty:
            bound[p.name] = p.default
    record = {"module": fn.__module__, "name": fn.__name__, "options": options,
              "args": {p.name: ("constexpr" if "constexpr" in str(p.annotation) else "") and repr(bound.get(p.name))
                       for p in params},
              "kinds": {p.name: _kind(bound.get(p.name)) for p in params}}
    key = json.dumps(record, sort_keys=True, default=str)
    if key not in _seen:
        _seen.add(key)
        _out.write(key + "\\n")
        _out.flush()
    kwargs.update(options)
    return _run(self, *args, grid=grid, warmup=warmup, **kwargs)

interpreter.InterpretedFunction.run = run
'''


def record(python: str, pytest_args: list[str], path: Path) -> int:
    """Run the tests in the interpreter with the recorder; the launches go to ``path`` (one JSON per line)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "xc_compile_recorder.py").write_text(RECORDER)
        env = dict(os.environ, TRITON_INTERPRET="1", XC_COMPILE_RECORD=str(path),
                   PYTHONPATH=os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")])))
        cmd = [python, "-m", "pytest", "-q", "-x", "-p", "xc_compile_recorder", "-p", "no:cacheprovider",
               *pytest_args]
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def signature_of(rec: dict, fn) -> tuple[dict, dict, dict]:
    """ASTSource's signature, constexprs and attributes for one recorded launch: as triton's launcher
    specialises, integers equal to 1 become constants and 16-byte-aligned tensors and integers divisible
    by 16 are marked so (which decides the loads' vector width, hence the registers)."""
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        kind, value, *more = rec["kinds"][name]
        if rec["args"][name]:                                          # a constexpr parameter
            consts[name] = value if kind in ("int", "float", "const") else rec["args"][name]
        elif kind == "tensordesc":                                     # a host-side tensor descriptor
            sig[name] = f"tensordesc<{DTYPES[value]}[{', '.join(map(str, more[0]))}]>"
            continue
        elif kind == "tensor":
            sig[name] = "*" + DTYPES[value]
            if more and more[0]:
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        elif kind == "int" and value == 1:
            consts[name] = 1
        elif kind == "int":
            sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
            continue
        elif kind == "float":
            sig[name] = "fp32"
            continue
        else:
            consts[name] = value
        sig[name] = "constexpr"
    return sig, consts, attrs


def gpu_forms(consts: dict) -> list[dict]:
    """The constexprs as recorded, with PDL on, and with IEEE off where the kernel has those switches."""
    forms = [dict(consts)]
    if "PDL" in consts:
        forms = [f | {"PDL": True} for f in forms]
    if "IEEE" in consts:
        forms = [f | {"IEEE": ieee} for f in forms for ieee in (True, False)]
    return forms


def resources(kernel, warps: int) -> str:
    """ptxas -v's registers and spills for a compiled kernel, its shared memory, and how many of its
    programs one SM holds by registers (65536 a SM, allocated per warp in units of 256)."""
    import re

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(kernel.asm["ptx"])
        out = subprocess.run([getattr(ptxas, "path", ptxas), "-v", "--gpu-name", "sm_90a", f"{tmp}/k.ptx", "-o",
                              f"{tmp}/k.o"], capture_output=True, text=True).stderr
    regs = int(re.search(r"Used (\d+) registers", out).group(1))
    stores = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", out))
    loads = sum(int(n) for n in re.findall(r"(\d+) bytes spill loads", out))
    per_sm = 65536 // (-(-regs * 32 // 256) * 256 * warps)
    return (f"{regs} registers, spills {stores} B stored / {loads} B loaded, {kernel.metadata.shared} bytes shared, "
            f"{per_sm} a SM")


def compile_all(path: Path, show: str | None = None) -> int:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    done, failures, counts = set(), [], Counter()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        fn = getattr(importlib.import_module(rec["module"]), rec["name"])
        sig, consts, attrs = signature_of(rec, fn)
        for form in gpu_forms(consts):
            key = json.dumps([rec["module"], rec["name"], sig, form, rec["options"], sorted(map(str, attrs))],
                             sort_keys=True, default=str)
            if key in done:
                continue
            done.add(key)
            try:
                kernel = triton.compile(ASTSource(fn, sig, form, attrs), target=target, options=dict(rec["options"]))
                counts[rec["name"]] += 1
                if show and show in rec["name"]:
                    told = {k: v for k, v in form.items() if k.isupper()}
                    marked = [n for i, n in enumerate(fn.arg_names) if (i,) in attrs]
                    print(f"{rec['name']} {rec['options']} {told} aligned {marked}: "
                          f"{resources(kernel, rec['options'].get('num_warps', 4))}")
            except Exception as e:                                     # noqa: BLE001 (report every failure)
                where = str(e).strip().splitlines()[-2:]
                cause = f" ({e.__cause__!r})" if e.__cause__ is not None else ""
                failures.append(f"{rec['module']}.{rec['name']} {form}: {type(e).__name__}{cause}: "
                                f"{' | '.join(where)}")
    print(f"triton {triton.__version__}, sm_90: {sum(counts.values())} launches of {len(counts)} kernels compiled")
    for name, n in sorted(counts.items()):
        print(f"  {name}: {n}")
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


def main() -> None:
    os.environ.pop("TRITON_INTERPRET", None)        # this process compiles: the kernels must be JIT functions
    args, python, show = sys.argv[1:], sys.executable, None
    while args[:1] in (["--tests-python"], ["--resources"]):
        if args[0] == "--tests-python":
            python = args[1]
        else:
            show = args[1]
        args = args[2:]
    args = args or ["tests/runtime/engines/kernels", "tests/runtime/decoding/kernels"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.jsonl"
        path.touch()
        rc = record(python, args, path)
        if rc not in (0, 5):
            print(f"compile_sm90: the tests failed (pytest exit {rc}); compiling what they launched")
        sys.exit(max(compile_all(path, show), 1 if rc not in (0, 5) else 0))


if __name__ == "__main__":
    main()
