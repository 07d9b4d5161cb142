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
