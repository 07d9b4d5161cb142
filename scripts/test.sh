#!/usr/bin/env bash
# The project's test command (README): the whole suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python -m pytest -q "$@"
