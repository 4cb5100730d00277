"""Hypothesis settings shared by the fuzz tests (tests/test_fuzz_*.py).

CI runs a fixed, derandomized set of examples per test, so a run is repeatable and its
cost known. A long hunt sets HIXL_FUZZ_SCALE (a multiplier of every test's example
count, e.g. 50) and gets fresh random examples each run; a failure prints the
`@reproduce_failure` blob that replays it.

    HIXL_FUZZ_SCALE=50 python -m pytest -q tests/test_fuzz_*.py --timeout 0

(--timeout 0: a long hunt outlasts the suite's per-test timeout.) For a coverage-guided
hunt on the codec alone, scripts/fuzz_wire.py runs atheris.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SCALE = max(1, int(os.environ.get("HIXL_FUZZ_SCALE", "1") or "1"))
LONG = SCALE > 1

settings.register_profile(
    "hixl-fuzz-ci", derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])
settings.register_profile(
    "hixl-fuzz-long", parent=settings.get_profile("hixl-fuzz-ci"), derandomize=False)
PROFILE = settings.get_profile("hixl-fuzz-long" if LONG else "hixl-fuzz-ci")


def fuzz_settings(examples: int) -> settings:
    """The profile with `examples` examples (times HIXL_FUZZ_SCALE): a test decorator."""
    return settings(PROFILE, max_examples=examples * SCALE)
