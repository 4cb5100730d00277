"""MoE dispatch and combine on `hixl.shmem` (DeepEP-style), and its single-process reference.

A job of `n_pes` PEs runs one mixture-of-experts layer. Every PE holds `tokens` tokens
`x[tokens, hidden]`, each routed to `topk` distinct experts (`expert_ids[tokens, topk]`)
with routing weights (`weights[tokens, topk]`, a softmax of the chosen scores). There are
`E = n_pes * experts_per_pe` experts; expert `e` lives on PE `e // experts_per_pe`.

**Dispatch.** Each PE sorts its (token, k) pairs by expert — stable, so by (expert,
token, k) — which makes the rows bound for one PE contiguous. For each destination it
packs one block: a header (epoch, where the results go back, row count, and the
per-(source, expert) counts), the rows' activations, and one metadata row per activation
(source rank, token, k, expert), into that PE's receive region *for this source*
(senders never collide), then a signal. The activations go straight from `x`: one
non-blocking `put_batch` of an `ArrayBatch` per destination, one move per row (rows of
neighbouring tokens coalesced), checked and issued without Python work per token; the
header and metadata are packed in the send area and follow in a second batch. Rows for
itself are packed straight into its own receive region.

**Expert compute.** A deterministic elementwise function per expert,
`y = x * scale[e] + bias[e]` (numpy multiply then add, in the layer's dtype), applied to
each (source, expert) run of received rows; parameters come from the seed, so every PE
and the reference agree on them. Elementwise on purpose: a matmul's result depends on
how BLAS blocks the rows, which would make the distributed result differ from the
reference in the last bit.

**Combine.** Each PE puts the result rows for a source back into the source's combine
buffer at the row offset the source named in the header: the combine buffer holds
`tokens * topk` rows in the source's own dispatch (sorted) order, so no two PEs write the
same rows. The source then reduces `out[t] = sum_k w[t, k] * y[t, k]` in k order,
accumulating in float32, where `y[t, k]` is found through the positions recorded at
dispatch (`Routing.index`, DeepEP's "handle").

**Signals and repetition.** A layer counts its passes (`epoch`). A sender SETs its slot
of the receiver's dispatch (then combine) signal to the epoch after its put; the receiver
waits until the slots sum to `n_pes * epoch`. No slot can run ahead: a PE starts pass
`e + 1` only after every PE's combine of pass `e` reached it, which each PE sends only
after it read everything sent to it in pass `e`. The same argument makes buffer reuse
safe without a barrier. Every received header carries the epoch, checked on arrival.

**Buffers** (one symmetric allocation, the *arena*; `BufferPlan`), sized for the worst
case: one source can send one PE at most `tokens * min(topk, experts_per_pe)` rows (a
token's experts are distinct, and a PE has `experts_per_pe` of them), so every PE has
`n_pes` receive blocks of that many rows; the send area holds all `tokens * topk` rows
once; results for each source get the same worst-case room; the combine buffer
`tokens * topk` rows. Layers of different shapes can share one arena (`arena=`), if a
`barrier_all` separates their use.

**Exactness.** `reference_output` computes the same thing in one process with the same
numpy operations in the same order (the same `apply_expert` on each expert's rows, the
same `weighted_sum`), so the distributed output must equal it bit for bit, in float32
and in float16 alike. numpy has no bfloat16; float16 is the low-precision case. As a
second check `check_output` compares with a float64 evaluation: within 1e-5 (float32)
or 1e-2 (float16), absolute plus relative (`TOLERANCE`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hixl.client.shmem import GE, SET, ArrayBatch, ShmemContext, SymmetricObject
from hixl.errors import ParamInvalid, TransferFailed
from hixl.memory import round_up

DTYPES: dict[str, type] = {"float32": np.float32, "float16": np.float16}
# float64 check: |out - out64| <= TOLERANCE * (1 + |out64|); float16 rounds each of its
# multiply, add and final cast to 11 bits (~5e-4 relative) on values up to ~8
TOLERANCE = {"float32": 1e-5, "float16": 1e-2}
META_FIELDS = ("source", "token", "k", "expert")  # one int32 each per dispatched row
_META_BYTES = 4 * len(META_FIELDS)
_SUM_CHUNK_BYTES = 1 << 20  # weighted_sum's working set per chunk of tokens
_HEADER_WORDS = 3  # epoch, row offset in the source's combine buffer, rows; then counts


@dataclass(frozen=True)
class MoeShape:
    """One layer's shape: tokens per PE (Bs), hidden size (H), experts per token (K),
    experts per PE, and the activations' dtype ("float32" or "float16")."""

    tokens: int
    hidden: int
    topk: int
    experts_per_pe: int
    dtype: str = "float32"

    def check(self, n_pes: int) -> None:
        for name in ("tokens", "hidden", "topk", "experts_per_pe"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamInvalid(f"MoE {name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ParamInvalid(f"MoE dtype must be one of {', '.join(DTYPES)} (numpy has no "
                               f"bfloat16), got {self.dtype!r}")
        if self.topk > self.n_experts(n_pes):
            raise ParamInvalid(f"topk {self.topk} needs at least that many experts: "
                               f"{n_pes} PEs x {self.experts_per_pe} = {self.n_experts(n_pes)}")

    def n_experts(self, n_pes: int) -> int:
        return n_pes * self.experts_per_pe

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(DTYPES[self.dtype])

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's activations."""
        return self.hidden * self.np_dtype.itemsize

    def __str__(self) -> str:
        return (f"Bs {self.tokens}, H {self.hidden}, K {self.topk}, "
                f"{self.experts_per_pe} experts/PE, {self.dtype}")


# ---------------------------------------------------------------- inputs and routing


@dataclass
class MoeInputs:
    """One PE's tokens and their routing."""

    x: np.ndarray            # [tokens, hidden], the layer's dtype
    expert_ids: np.ndarray   # [tokens, topk] int64, distinct per token
    weights: np.ndarray      # [tokens, topk] float32, each row sums to ~1


def make_inputs(shape: MoeShape, n_pes: int, pe: int, iteration: int = 0,
                seed: int = 0) -> MoeInputs:
    """PE `pe`'s tokens for one pass, a pure function of its arguments: any process can
    recompute any PE's inputs (that is what the reference does)."""
    rng = np.random.default_rng([seed, 1, pe, iteration])
    x = rng.standard_normal((shape.tokens, shape.hidden), dtype=np.float32)
    scores = rng.standard_normal((shape.tokens, shape.n_experts(n_pes)), dtype=np.float32)
    expert_ids = np.argsort(-scores, axis=1, kind="stable")[:, :shape.topk]
    chosen = np.take_along_axis(scores, expert_ids, axis=1).astype(np.float64)
    weights = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    return MoeInputs(x.astype(shape.np_dtype), expert_ids, weights.astype(np.float32))


def expert_params(shape: MoeShape, n_pes: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every expert's (scale, bias), each [n_experts, hidden] in the layer's dtype."""
    rng = np.random.default_rng([seed, 2])
    size = (shape.n_experts(n_pes), shape.hidden)
    scale = rng.uniform(0.5, 1.5, size).astype(shape.np_dtype)
    bias = rng.uniform(-0.5, 0.5, size).astype(shape.np_dtype)
    return scale, bias


def apply_expert(x: np.ndarray, scale: np.ndarray, bias: np.ndarray, out: np.ndarray) -> None:
    """Expert compute, `out = x * scale + bias`: the one definition both sides use."""
    np.multiply(x, scale, out=out)
    np.add(out, bias, out=out)


def weighted_sum(rows: np.ndarray, index: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`out[t] = sum_k weights[t, k] * rows[index[t, k]]`, accumulated in float32 in k
    order and cast to the rows' dtype: the one reduction both sides use."""
    tokens, topk = index.shape
    hidden = rows.shape[1]
    # tokens in chunks of ~1 MiB of float32: the accumulator and the term stay in cache
    # across the k passes (the same operations per element, in the same order)
    chunk = max(1, min(tokens, _SUM_CHUNK_BYTES // (4 * hidden)))
    out = np.empty((tokens, hidden), rows.dtype)
    acc_buf = np.empty((chunk, hidden), np.float32)
    picked_buf = np.empty((chunk, hidden), rows.dtype)  # reused: no allocation per k
    term_buf = picked_buf if rows.dtype == np.float32 else np.empty_like(acc_buf)
    for start in range(0, tokens, chunk):
        stop = min(start + chunk, tokens)
        acc, picked, term = (buf[:stop - start] for buf in (acc_buf, picked_buf, term_buf))
        acc[...] = 0
        for k in range(topk):
            np.take(rows, index[start:stop, k], axis=0, out=picked, mode="clip")  # "raise" buffers
            if term is not picked:
                term[...] = picked
            term *= weights[start:stop, k, None]
            acc += term
        out[start:stop] = acc
    return out


@dataclass
class Routing:
    """Where one PE's (token, k) rows go, in dispatch order (sorted by expert): combine's
    handle. Flat row r = token * topk + k."""

    order: np.ndarray     # dispatch position -> flat row
    experts: np.ndarray   # dispatch position -> expert
    counts: np.ndarray    # rows per expert [n_experts]
    rows_to: np.ndarray   # rows per destination PE [n_pes]
    first: np.ndarray     # first dispatch position of each destination PE [n_pes]
    index: np.ndarray     # [tokens, topk]: dispatch position of (token, k)


def route(expert_ids: np.ndarray, shape: MoeShape, n_pes: int) -> Routing:
    flat = expert_ids.ravel()
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=shape.n_experts(n_pes))
    rows_to = counts.reshape(n_pes, shape.experts_per_pe).sum(axis=1)
    first = np.concatenate([[0], np.cumsum(rows_to)[:-1]])
    position = np.empty_like(order)
    position[order] = np.arange(order.size)
    return Routing(order, flat[order], counts, rows_to, first,
                   position.reshape(expert_ids.shape))


# ---------------------------------------------------------------- the reference


def reference_output(shape: MoeShape, n_pes: int, pe: int, iteration: int = 0,
                     seed: int = 0) -> np.ndarray:
    """PE `pe`'s layer output computed in this process alone, with the same operations in
    the same order as the distributed layer: the distributed output equals it exactly."""
    inputs = make_inputs(shape, n_pes, pe, iteration, seed)
    scale, bias = expert_params(shape, n_pes, seed)
    routing = route(inputs.expert_ids, shape, n_pes)
    y = np.empty((routing.order.size, shape.hidden), shape.np_dtype)
    start = 0
    for expert, count in enumerate(routing.counts):
        rows = routing.order[start:start + count]
        apply_expert(inputs.x[rows // shape.topk], scale[expert], bias[expert],
                     y[start:start + count])
        start += count
    return weighted_sum(y, routing.index, inputs.weights)


def reference_all(shape: MoeShape, n_pes: int, iteration: int = 0,
                  seed: int = 0) -> list[np.ndarray]:
    """Every PE's output, as one process computes them."""
    return [reference_output(shape, n_pes, pe, iteration, seed) for pe in range(n_pes)]


def float64_output(shape: MoeShape, n_pes: int, pe: int, iteration: int = 0,
                   seed: int = 0) -> np.ndarray:
    """The same layer in float64 (from the same low-precision inputs and parameters)."""
    inputs = make_inputs(shape, n_pes, pe, iteration, seed)
    scale, bias = (p.astype(np.float64) for p in expert_params(shape, n_pes, seed))
    ids = inputs.expert_ids
    y = inputs.x.astype(np.float64)[:, None, :] * scale[ids] + bias[ids]
    return np.einsum("tk,tkh->th", inputs.weights.astype(np.float64), y)


@dataclass
class OutputCheck:
    """A PE's output against the reference: bit-equal, and its distance from float64."""

    exact: bool
    max_abs_err: float     # vs the float64 evaluation
    tolerance: float
    within_tolerance: bool

    @property
    def ok(self) -> bool:
        return self.exact and self.within_tolerance

    def as_dict(self) -> dict[str, Any]:
        return {"exact": self.exact, "max_abs_err": self.max_abs_err,
                "tolerance": self.tolerance, "within_tolerance": self.within_tolerance,
                "ok": self.ok}


def check_output(out: np.ndarray, shape: MoeShape, n_pes: int, pe: int, iteration: int = 0,
                 seed: int = 0, *, reference: np.ndarray | None = None) -> OutputCheck:
    """Compare PE `pe`'s output with the reference (computed unless given)."""
    if reference is None:
        reference = reference_output(shape, n_pes, pe, iteration, seed)
    exact = out.shape == reference.shape and out.dtype == reference.dtype and \
        np.array_equal(out, reference)
    wide = float64_output(shape, n_pes, pe, iteration, seed)
    tol = TOLERANCE[shape.dtype]
    err = np.abs(out.astype(np.float64) - wide)
    return OutputCheck(exact, float(err.max(initial=0.0)), tol,
                       bool(np.all(err <= tol * (1.0 + np.abs(wide)))))


# ---------------------------------------------------------------- the layer on hixl.shmem


@dataclass(frozen=True)
class BufferPlan:
    """Byte offsets in the arena of every region one PE needs (see the module docstring)."""

    shape: MoeShape
    n_pes: int

    @property
    def header_bytes(self) -> int:
        return round_up((_HEADER_WORDS + self.shape.experts_per_pe) * 8, 64)

    @property
    def max_rows(self) -> int:
        """Rows one source can send one PE: each token at most once per expert there."""
        return self.shape.tokens * min(self.shape.topk, self.shape.experts_per_pe)

    def meta_at(self, rows: int) -> int:
        """Offset of the metadata rows in a block of `rows` rows."""
        return round_up(self.header_bytes + rows * self.shape.row_bytes, 16)

    def block_bytes(self, rows: int) -> int:
        return round_up(self.meta_at(rows) + rows * _META_BYTES, 64)

    @property
    def recv_at(self) -> int:
        return 0

    @property
    def recv_block(self) -> int:
        return self.block_bytes(self.max_rows)

    @property
    def send_at(self) -> int:
        return self.recv_at + self.n_pes * self.recv_block

    @property
    def send_bytes(self) -> int:
        total = self.shape.tokens * self.shape.topk  # every row once, in n_pes blocks
        return round_up(self.n_pes * (self.header_bytes + 16 + 64)
                        + total * (self.shape.row_bytes + _META_BYTES), 64)

    @property
    def results_at(self) -> int:
        return self.send_at + self.send_bytes

    @property
    def results_slot(self) -> int:
        return round_up(self.max_rows * self.shape.row_bytes, 64)

    @property
    def combine_at(self) -> int:
        return self.results_at + self.n_pes * self.results_slot

    @property
    def total(self) -> int:
        return self.combine_at + self.shape.tokens * self.shape.topk * self.shape.row_bytes


def heap_bytes(shapes: MoeShape | list[MoeShape], n_pes: int) -> int:
    """Symmetric heap a job needs for layers of these shapes sharing one arena, plus room
    for their signals."""
    shapes = [shapes] if isinstance(shapes, MoeShape) else shapes
    return round_up(max(BufferPlan(s, n_pes).total for s in shapes), 1 << 20) + (1 << 20)


@dataclass
class Received:
    """The block one source dispatched to this PE."""

    source: int
    row_offset: int        # where its results go in the source's combine buffer
    counts: np.ndarray     # rows per local expert, in order
    x: np.ndarray          # [rows, hidden]
    meta: np.ndarray       # [rows, 4] int32: source, token, k, expert

    @property
    def rows(self) -> int:
        return int(self.x.shape[0])


@dataclass
class Dispatched:
    """What dispatch leaves for compute and combine."""

    epoch: int
    routing: Routing
    received: list[Received]


@dataclass
class StepTimes:
    """Seconds each phase of the last `forward` took on this PE."""

    dispatch: float = 0.0
    compute: float = 0.0
    combine: float = 0.0


@dataclass(eq=False)
class MoeLayer:
    """A distributed MoE layer on a `hixl.shmem` context. Construction is collective
    (it allocates the arena, unless given one, and two signals)."""

    ctx: ShmemContext
    shape: MoeShape
    seed: int = 0
    arena: SymmetricObject | None = None
    timeout: float | None = None
    epoch: int = 0
    times: StepTimes = field(default_factory=StepTimes)

    def __post_init__(self) -> None:
        n = self.ctx.n_pes
        self.shape.check(n)
        self.plan = BufferPlan(self.shape, n)
        if self.arena is None:
            self.arena = self.ctx.malloc(self.plan.total, name="moe-arena")
        elif self.arena.dtype != np.uint8 or len(self.arena.shape) != 1 or \
                self.arena.nbytes < self.plan.total:
            raise ParamInvalid(f"the MoE arena must be uint8[>= {self.plan.total}] (malloc), "
                               f"got {self.arena!r}")
        self._bytes = self.arena.local
        self._dispatched = self.ctx.create_signal("moe-dispatched")
        self._combined = self.ctx.create_signal("moe-combined")
        self.scale, self.bias = expert_params(self.shape, n, self.seed)

    # -------------------------------------------------------------- views

    def _view(self, offset: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
        return self._bytes[offset:offset + nbytes].view(dtype).reshape(shape)

    def _block(self, at: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Header words, activations and metadata of a block of `rows` rows at `at`."""
        plan, shape = self.plan, self.shape
        header = self._view(at, plan.header_bytes, np.int64, (plan.header_bytes // 8,))
        x = self._view(at + plan.header_bytes, rows * shape.row_bytes, shape.np_dtype,
                       (rows, shape.hidden))
        meta = self._view(at + plan.meta_at(rows), rows * _META_BYTES, np.int32,
                          (rows, len(META_FIELDS)))
        return header, x, meta

    def _order(self) -> list[int]:
        """Destinations starting after this PE (spreads the load), this PE last."""
        me, n = self.ctx.my_pe, self.ctx.n_pes
        return [(me + i) % n for i in range(1, n + 1)]

    # -------------------------------------------------------------- the three phases

    def dispatch(self, x: np.ndarray, expert_ids: np.ndarray) -> Dispatched:
        """Send every (token, k) row to the PE of its expert; wait for every PE's rows."""
        shape, plan, ctx = self.shape, self.plan, self.ctx
        me, n = ctx.my_pe, ctx.n_pes
        if x.shape != (shape.tokens, shape.hidden) or x.dtype != shape.np_dtype or \
                expert_ids.shape != (shape.tokens, shape.topk):
            raise ParamInvalid(f"dispatch needs x[{shape.tokens}, {shape.hidden}] "
                               f"{shape.dtype} and expert_ids[{shape.tokens}, {shape.topk}], "
                               f"got {x.shape} {x.dtype} and {expert_ids.shape}")
        self.epoch += 1
        routing = route(expert_ids, shape, n)
        send_at = plan.send_at
        target = plan.recv_at + me * plan.recv_block  # this PE's receive block on every PE
        last = self._order()[-2] if n > 1 else me
        for dest in self._order():
            rows = int(routing.rows_to[dest])
            positions = slice(routing.first[dest], routing.first[dest] + rows)
            flat = routing.order[positions]
            tokens = flat // shape.topk
            # header and metadata: packed here (this PE's own block: in place), the
            # rows for another PE put straight from `x`, one move per row (no send copy)
            at = target if dest == me else send_at
            header, block_x, meta = self._block(at, rows)
            header[:_HEADER_WORDS] = (self.epoch, routing.first[dest], rows)
            local = slice(dest * shape.experts_per_pe, (dest + 1) * shape.experts_per_pe)
            header[_HEADER_WORDS:_HEADER_WORDS + shape.experts_per_pe] = routing.counts[local]
            meta[:, 0] = me
            meta[:, 1] = tokens
            meta[:, 2] = flat % shape.topk
            meta[:, 3] = routing.experts[positions]
            if dest == me:
                np.take(x, tokens, axis=0, out=block_x, mode="clip")
                continue
            row_bytes, meta_at = shape.row_bytes, plan.meta_at(rows)
            # the last destination's rows move in this thread while the others' are in flight
            ctx.put_batch(ArrayBatch(self.arena, x, target + plan.header_bytes
                                     + np.arange(rows) * row_bytes, tokens * row_bytes,
                                     row_bytes), dest, nbi=dest != last, timeout=self.timeout)
            ctx.put_batch(ArrayBatch(self.arena, self.arena, [target, target + meta_at],
                                     [at, at + meta_at], [plan.header_bytes, rows * _META_BYTES]),
                          dest, nbi=True, timeout=self.timeout)
            send_at += plan.block_bytes(rows)
        for dest in self._order():  # each signal follows its put's bytes (hixl.shmem)
            ctx.signal(self._dispatched, self.epoch, dest, SET, timeout=self.timeout)
        ctx.wait_until(self._dispatched, GE, n * self.epoch, self.timeout)
        return Dispatched(self.epoch, routing, [self._received(s) for s in range(n)])

    def _received(self, source: int) -> Received:
        plan, epp = self.plan, self.shape.experts_per_pe
        at = plan.recv_at + source * plan.recv_block
        header = self._view(at, _HEADER_WORDS * 8, np.int64, (_HEADER_WORDS,))
        epoch, row_offset, rows = (int(v) for v in header)
        total = self.shape.tokens * self.shape.topk
        if epoch != self.epoch or not 0 <= rows <= plan.max_rows or \
                not 0 <= row_offset <= total - rows:
            raise TransferFailed(f"PE {self.ctx.my_pe}: the dispatch block from PE {source} "
                                 f"says epoch {epoch}, {rows} rows at row {row_offset}; "
                                 f"expected epoch {self.epoch}, at most {plan.max_rows} rows "
                                 f"within {total}", failed=[source])
        header, x, meta = self._block(at, rows)
        counts = header[_HEADER_WORDS:_HEADER_WORDS + epp].copy()
        if int(counts.sum()) != rows:
            raise TransferFailed(f"PE {self.ctx.my_pe}: PE {source}'s expert counts "
                                 f"{counts.tolist()} do not add up to its {rows} rows",
                                 failed=[source])
        return Received(source, row_offset, counts, x, meta)

    def compute(self, dispatched: Dispatched) -> None:
        """Each local expert on its rows from each source, into the results to send back
        (rows from this PE straight into its own combine buffer)."""
        me, shape, plan = self.ctx.my_pe, self.shape, self.plan
        for block in dispatched.received:
            if block.source == me:
                at = plan.combine_at + block.row_offset * shape.row_bytes
            else:
                at = plan.results_at + block.source * plan.results_slot
            out = self._view(at, block.rows * shape.row_bytes, shape.np_dtype,
                             (block.rows, shape.hidden))
            start = 0
            for local, count in enumerate(block.counts.tolist()):
                expert = me * shape.experts_per_pe + local
                apply_expert(block.x[start:start + count], self.scale[expert],
                             self.bias[expert], out[start:start + count])
                start += count

    def combine(self, dispatched: Dispatched, weights: np.ndarray) -> np.ndarray:
        """Send every result row back to its source; reduce this PE's tokens' K results."""
        ctx, shape, plan = self.ctx, self.shape, self.plan
        me, n = ctx.my_pe, ctx.n_pes
        by_source = {block.source: block for block in dispatched.received}
        last = self._order()[-2] if n > 1 else me
        for source in self._order():
            block = by_source[source]
            if source != me and block.rows:
                nbytes = block.rows * shape.row_bytes
                at = plan.results_at + source * plan.results_slot
                target = plan.combine_at + block.row_offset * shape.row_bytes
                put = ctx.put if source == last else ctx.put_nbi  # the last one: this thread
                put(self.arena[target:target + nbytes], self._bytes[at:at + nbytes], source,
                    timeout=self.timeout)
        for source in self._order():
            ctx.signal(self._combined, dispatched.epoch, source, SET, timeout=self.timeout)
        ctx.wait_until(self._combined, GE, n * dispatched.epoch, self.timeout)
        total = shape.tokens * shape.topk
        rows = self._view(plan.combine_at, total * shape.row_bytes, shape.np_dtype,
                          (total, shape.hidden))
        return weighted_sum(rows, dispatched.routing.index, weights)

    def forward(self, inputs: MoeInputs) -> np.ndarray:
        """dispatch, compute, combine; `times` keeps each phase's seconds."""
        started = time.perf_counter()
        dispatched = self.dispatch(inputs.x, inputs.expert_ids)
        dispatched_at = time.perf_counter()
        self.compute(dispatched)
        computed_at = time.perf_counter()
        out = self.combine(dispatched, inputs.weights)
        self.times = StepTimes(dispatched_at - started, computed_at - dispatched_at,
                               time.perf_counter() - computed_at)
        return out


def check_metadata(dispatched: Dispatched, shape: MoeShape, n_pes: int, my_pe: int,
                   iteration: int = 0, seed: int = 0) -> list[str]:
    """Problems with the rows this PE received, against each source's recomputed routing:
    every (source, token, k) must name an expert of this PE that the source chose, every
    such row must have come exactly once, grouped by expert as the counts say."""
    problems: list[str] = []
    mine = range(my_pe * shape.experts_per_pe, (my_pe + 1) * shape.experts_per_pe)
    for block in dispatched.received:
        ids = make_inputs(shape, n_pes, block.source, iteration, seed).expert_ids
        source, tokens, ks, experts = (block.meta[:, i] for i in range(len(META_FIELDS)))
        wanted = np.argwhere((ids >= mine.start) & (ids < mine.stop))  # (token, k) pairs
        got = np.stack([tokens, ks], axis=1)
        if not np.all(source == block.source):
            problems.append(f"rows from PE {block.source} name another source")
        if len(got) != len(wanted) or not np.array_equal(
                np.unique(got, axis=0), wanted) or len(np.unique(got, axis=0)) != len(got):
            problems.append(f"PE {block.source} sent (token, k) pairs that are not exactly "
                            f"its choices of experts on PE {my_pe}")
            continue
        if not np.array_equal(ids[tokens, ks], experts):
            problems.append(f"rows from PE {block.source} name the wrong expert")
        grouped = np.repeat(np.asarray(mine), block.counts)
        if not np.array_equal(grouped, experts):
            problems.append(f"PE {block.source}'s per-expert counts {block.counts.tolist()} "
                            f"do not match its rows")
    return problems


def moved_bytes(shape: MoeShape, n_pes: int) -> int:
    """Token bytes one pass moves in all: each (token, k) row out and its result back."""
    return 2 * n_pes * shape.tokens * shape.topk * shape.row_bytes


__all__ = [
    "DTYPES", "META_FIELDS", "TOLERANCE",
    "BufferPlan", "Dispatched", "MoeInputs", "MoeLayer", "MoeShape", "OutputCheck",
    "Received", "Routing", "StepTimes",
    "apply_expert", "check_metadata", "check_output", "expert_params", "float64_output",
    "heap_bytes", "make_inputs", "moved_bytes", "reference_all", "reference_output", "route",
    "weighted_sum",
]
