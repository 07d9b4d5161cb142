#!/usr/bin/env bash
# Create .venv and install the project (the whole service, calibration) with its test tools.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first: on a CPU machine the CPU build (2.13.0 is the version CI uses); any torch >= 2.5 works.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[server,calibrate,dev]"
# Triton, where none came with torch: the CPU tests run the CUDA kernels through its
# interpreter and compile them for sm_90 (tests/test_*_triton.py). 3.6.0 is the version the
# GPU hosts run; later interpreters refuse the scalar masks of the DeltaNet kernels' loads.
if [ "$(uname -sm)" = "Linux x86_64" ]; then   # the platform triton ships wheels for
    .venv/bin/python -c "import triton" 2>/dev/null || .venv/bin/python -m pip install -q "triton==3.6.0"
fi
