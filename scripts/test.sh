#!/usr/bin/env bash
# The project's test command: the whole suite on the CPU, inside .venv (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q "$@"
