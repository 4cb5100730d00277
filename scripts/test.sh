#!/usr/bin/env bash
# Set up .venv (only when needed), then run every check: `ruff check .`, then pytest.
#
#   bash scripts/test.sh                 # the whole suite (what CI runs)
#   bash scripts/test.sh -k wire -x      # extra arguments go to pytest
#   bash scripts/test.sh -m unit         # only the unit tests (kinds: tests/conftest.py)
#
# pytest runs even when ruff finds problems, so one run reports both. Exits non-zero when
# anything fails, including pytest collecting no tests (pytest's exit 5).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=scripts/venv.sh
. scripts/venv.sh
hixl_ensure_venv "$root"

lint=0
.venv/bin/ruff check . || lint=$?

tests=0
.venv/bin/python -m pytest -q -ra "$@" || tests=$?
if ((tests == 5)); then
    echo "test.sh: pytest collected no tests, which counts as a failure" >&2
fi
if ((lint != 0)); then
    echo "test.sh: ruff check failed (exit $lint)" >&2
    exit "$lint"
fi
exit "$tests"
