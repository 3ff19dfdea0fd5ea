#!/usr/bin/env bash
# The project's test command: lint, format check, type check, then the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/check.sh -m "not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
"$PY" -m pytest "$@"
