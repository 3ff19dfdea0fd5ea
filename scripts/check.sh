#!/usr/bin/env bash
# The project's test command: lint, format check, type check, then the test suite.
# Extra arguments go to pytest; without any, the default run skips the `slow` marker (a few minutes),
# which `.ci/run` then runs too (`bash scripts/check.sh -m slow`, or everything: `-m "slow or not slow"`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
if [ "$#" -eq 0 ]; then
  set -- -m "not slow" --durations=20  # the slowest tests: the default run should stay well under 15 minutes
fi
"$PY" -m pytest "$@"
