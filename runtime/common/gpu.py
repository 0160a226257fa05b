"""Where the Triton kernels run: a CUDA GPU, or Triton's CPU interpreter (tests), and how they are launched.

Both kernel packages use it: the fast backend's step kernels (runtime/engines/kernels/) and the generation
loop's kernels (runtime/decoding/kernels/). On a machine without a CUDA device the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1``, set before triton is imported), which is how CI checks their logic
against the torch references; two shims below make the interpreter round and run as the GPU does.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def available() -> bool:
    """Whether triton is importable (the kernels also need a CUDA device or the interpreter)."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether the kernels run in Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def pdl_capable() -> bool:
    """Whether the GPU has programmatic dependent launch (sm_90+): a kernel may start while the previous one
    drains and wait for its results with gdc_wait, its weight loads issued before the wait."""
    return not interpreted() and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def launch_options(pdl: bool) -> dict:
    """Launch options of a kernel whose PDL constexpr is ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


def ieee_dot(dtype: torch.dtype) -> bool:
    """Whether tl.dot must multiply in full fp32: fp32 engines (not tf32), and the interpreter, whose
    bf16 tl.dot is wrong (it multiplies the raw bits)."""
    return dtype == torch.float32 or interpreted()


def _interpreter_fixes() -> None:
    """Two shims for Triton's CPU interpreter (tests only; nothing changes on a GPU):
    - round fp32 -> bf16 to nearest even, as the GPU does: the interpreter truncates (its
      ``create_fp_trunc`` ignores the rounding mode), which would double every rounding error the
      tests compare against the torch references;
    - patch triton.language once per kernel launch, not again at every nested @triton.jit helper
      call (the enclosing launch has patched it already): this re-patching was ~40 % of the time."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    patch_lang = interpreter._patch_lang

    def patch_lang_once(fn):
        # the language modules this function sees (triton.language and/or triton.language.core)
        langs = [v for v in fn.__globals__.values() if v is tl or v is tl.core]
        if langs and not any(tl.core.is_builtin(lang.full) for lang in langs):   # patched by the enclosing launch
            return interpreter._LangPatchScope()
        return patch_lang(fn)

    interpreter._patch_lang = patch_lang_once

    cast = InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return TensorHandle(bits.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    InterpreterBuilder.cast_impl = cast_impl


if interpreted() and available():
    _interpreter_fixes()
