"""hixl._fastwire.frame_spans: an array batch cut into vector requests in C, exactly as
hixl.transports.tcp._frame_spans does it in numpy (the fallback without a compiler)."""

from __future__ import annotations

import numpy as np
import pytest

from hixl import wire
from hixl.memory import load_fastwire
from hixl.transports import tcp


@pytest.mark.parametrize("seed", range(6))
def test_frame_spans_in_c_cut_every_batch_as_numpy_does(seed: int) -> None:
    """`_fastwire.frame_spans` against `tcp._frame_spans` (numpy) on random array batches:
    segment switches, runs adjacent on one side, both or neither, pages of mixed sizes,
    limits that split ranges and spans, small max_ranges. Equal output, span by span."""
    frame_spans = getattr(load_fastwire(), "frame_spans", None)
    if frame_spans is None:
        pytest.skip("hixl._fastwire is not built here (no compiler) or HIXL_FASTWIRE=0")
    rng = np.random.default_rng(seed)
    for _ in range(40):
        count = int(rng.integers(1, 300))
        lengths = rng.choice([1, 64, 4096, 147456], count).astype(np.int64)
        seg = np.cumsum(rng.random(count) < 0.05).astype(np.int64) % 3
        local_gap = np.where(rng.random(count) < 0.3, rng.integers(1, 9999, count), 0)
        remote_gap = np.where(rng.random(count) < 0.3, rng.integers(1, 9999, count), 0)
        local = (1 << 40) + np.cumsum(np.concatenate(([0], lengths[:-1])) + local_gap)
        remote = (1 << 44) + np.cumsum(np.concatenate(([0], lengths[:-1])) + remote_gap)
        limit = int(rng.choice([147456, 300_000, 1 << 20, 64 << 20]))
        max_ranges = int(rng.choice([1, 3, 16, wire.MAX_VECTOR_RANGES]))
        args = (seg, local.astype(np.int64), remote.astype(np.int64), lengths, limit,
                max_ranges)
        assert frame_spans(*args) == tcp._frame_spans(*args)
    with pytest.raises(ValueError, match=r"lengths\[1\] is negative"):
        frame_spans(*(np.zeros(2, np.int64),) * 3, np.array([5, -1]), 10, 4)
    with pytest.raises(TypeError, match="local must be an int64 array"):
        frame_spans(np.zeros(2, np.int64), np.zeros(2, np.int32), np.zeros(2, np.int64),
                    np.ones(2, np.int64), 10, 4)
    assert frame_spans(*(np.zeros(0, np.int64),) * 4, 10, 4) == []
