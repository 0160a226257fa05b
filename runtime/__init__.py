"""xcompile's runtime: run engine dirs with speculative decoding, from Python or the ``xrun`` CLI.

    from xcompile.runtime import LLM, SamplingParams
    llm = LLM("engines/qwen3-8b")
    print(llm.generate("The capital of France is", max_new_tokens=16)[0].text)

The names below load lazily (``xrun --help`` stays instant): ``LLM``, ``Completion``, ``Output`` (api.py),
``SamplingParams`` (decoding/sampling.py), ``TreeShape`` (decoding/registry.py), ``KernelConfig``
(engines/kernels/config.py), ``XcompileError`` / ``EngineError`` (common/errors.py).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "xcompile.runtime.api", "Completion": "xcompile.runtime.api", "Output": "xcompile.runtime.api",
    "SamplingParams": "xcompile.runtime.decoding.sampling", "TreeShape": "xcompile.runtime.decoding.registry",
    "KernelConfig": "xcompile.runtime.engines.kernels.config",
    "XcompileError": "xcompile.runtime.common.errors", "EngineError": "xcompile.runtime.common.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'xcompile.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)
