#!/usr/bin/env bash
# The project's test command: lint, format check, type check, then the default tests in two pytest-xdist
# workers (one file per worker at a time; $JAXSERVE_TEST_WORKERS to change; it prints its 20 slowest tests).
# Extra arguments go to pytest instead of the default selection:
#   bash scripts/check.sh -m "slow and not timing"   the heavier deterministic checks (`.ci/run` runs them too)
#   bash scripts/check.sh -m heavy                   minutes-long checks (real model download, largest plans), by hand
#   bash scripts/check.sh -m timing                  wall-clock checks, by hand on a quiet machine (never in CI)
#   bash scripts/check.sh -x tests/test_llm.py       one file
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
"$PY" -m mypy
if [ "$#" -eq 0 ]; then
  # Deterministic and quick: a `timing` verdict depends on the machine's hour, a `slow` one takes minutes.
  # One process leaves a 2-core box ~40 % idle (compiles are single-threaded); two workers fill it.
  set -- -m "not slow and not timing and not heavy" -n "${JAXSERVE_TEST_WORKERS:-2}" --dist loadfile --durations=20
fi
"$PY" -m pytest "$@"
