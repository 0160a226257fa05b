#!/usr/bin/env bash
# Create .venv and install xcompile with its test, TensorRT-RTX, serving (FastAPI, Ray Serve) and quantize
# (llm-compressor) extras.
# torch is pinned first: on the project's CPU machines `torch==2.13.0` is a local CPU wheel, while an
# unpinned torch would pull a multi-GB CUDA build. On a GPU box, install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# setuptools notes every editable install of a package-dir mapping ("Editable installation. Please be
# careful with folders ... with the same name as your package"): information only, nothing to fix
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[dev,trt,plot,serve-ray,quantize]"
