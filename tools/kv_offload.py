"""KV-cache offload on `hixl.shmem`: a paged KV cache offloaded to a host pool on other
PEs, and per decode step only the top-k blocks gathered back.

Roles. PE 0 is the *inference* process: its "device" KV cache is a local numpy array
[layers, blocks, page_bytes] (vLLM's paged layout: per layer, one page of `page_bytes` — a
block's K and V for that layer — per block). PEs 1..n-1 hold the *host pool*, sharded by
block id: block b lives on PE 1 + b % pool_pes, in slot b // pool_pes.

Pool layout: a symmetric uint8 tensor [slots, layers, page_bytes] — block-major, so one
block's pages across all layers are one contiguous range: the unit a host pool (or a
Mooncake store value, 61 layers x 144 KiB = 8784 KiB) keeps, evicts and frees, and the
device cache's layer-major pages each map to one place in it. Symmetric allocation gives
every PE the same objects, PE 0 included: PE 0's copy of the pool is one shard's worth of
memory it does not need for the scenario (the bench uses it for its memcpy baseline);
sharding over more pool PEs shrinks it with the shards.

Phases.
- *Prefill* (`InferenceSide.prefill`): layer by layer, PE 0 fills its cache (a stand-in
  for the model's forward pass) and offloads that layer's pages with one non-blocking
  batched PUT per pool PE (`put_batch(ArrayBatch, nbi=True)`), so the transfer of layer l overlaps
  the "compute" of layer l+1; one `quiet` at the end, then a signal per pool PE (a signal
  is never seen before the puts issued before it).
- *Decode* (`InferenceSide.decode_step`): each step scores the blocks (a seeded RNG, the
  same in every run), takes the top-k with argpartition, and gathers only those blocks,
  every layer, into a compact buffer [layers, k, page_bytes] with one batched GET per
  pool PE; then checks them page for page.

Batches are `ArrayBatch`es (offset arrays built with a few numpy operations per layer or
step: `offload_batches`, `gather_batches`), checked and copied without Python work per
page; `offload_pairs` / `gather_pairs` list the same moves as (dst, src) pairs.

Content. Every page is a function of (layer, block, generation): a fixed noise pattern
XOR a tag word made from the three, so any process can check any page with no data from
another, a page that landed in the wrong place fails, and a re-offload with the next
generation proves that its bytes moved rather than stayed from the last run.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hixl.client.shmem import GE, ArrayBatch, ShmemContext
from hixl.errors import ParamInvalid

INFERENCE_PE = 0
NOISE_SEED = 0x6B76  # "kv"
SCORE_SEED = 2024
_TAG_MULT = np.uint64(0x9E3779B97F4A7C15)
_WORD = 8
HEAP_SLACK = 64 << 10  # signals and verdicts beside the pool


@dataclass(frozen=True)
class KvLayout:
    """L layers x N blocks of `page_bytes` per layer, offloaded to `pool_pes` PEs."""

    layers: int
    blocks: int
    page_bytes: int  # one block in one layer: its K and V (e.g. 128 KiB + 16 KiB)
    pool_pes: int = 1

    def __post_init__(self) -> None:
        for name in ("layers", "blocks", "page_bytes", "pool_pes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamInvalid(f"KvLayout.{name} must be a positive integer, got {value!r}")
        if self.page_bytes % _WORD:
            raise ParamInvalid(f"KvLayout.page_bytes must be a multiple of {_WORD}, got "
                               f"{self.page_bytes}")

    @property
    def block_bytes(self) -> int:
        """One block over every layer: 61 x 144 KiB = 8784 KiB for the seed's model."""
        return self.layers * self.page_bytes

    @property
    def slots(self) -> int:
        """Blocks one pool PE holds (the pool tensor's first dimension)."""
        return math.ceil(self.blocks / self.pool_pes)

    @property
    def n_pes(self) -> int:
        return 1 + self.pool_pes

    @property
    def heap_bytes(self) -> int:
        """The symmetric heap every PE needs (`init`'s heap_size)."""
        return self.slots * self.block_bytes + HEAP_SLACK

    def home(self, block: int) -> tuple[int, int]:
        """(pool PE, slot) of block `block`."""
        return 1 + block % self.pool_pes, block // self.pool_pes


@functools.lru_cache(maxsize=4)
def _noise(page_bytes: int) -> np.ndarray:
    words = np.random.default_rng(NOISE_SEED).integers(0, 1 << 63, page_bytes // _WORD,
                                                       dtype=np.uint64)
    words.flags.writeable = False
    return words


def _tag(layer: int, block: int, generation: int) -> np.uint64:
    key = ((generation & 0xFFFF) << 48) | ((layer & 0xFFFF) << 32) | (block & 0xFFFFFFFF)
    return np.uint64(key) * _TAG_MULT + np.uint64(1)  # never 0: a zeroed page fails


def fill_page(out: np.ndarray, layer: int, block: int, generation: int) -> None:
    """Write page (layer, block, generation)'s content into `out` (uint8, page_bytes)."""
    with np.errstate(over="ignore"):
        np.bitwise_xor(_noise(out.nbytes), _tag(layer, block, generation),
                       out=out.view(np.uint64))


def page_ok(page: np.ndarray, layer: int, block: int, generation: int) -> bool:
    """True when `page` holds exactly page (layer, block, generation)'s content."""
    with np.errstate(over="ignore"):
        words = page.view(np.uint64)
        return bool(np.array_equal(words ^ _tag(layer, block, generation),
                                   _noise(page.nbytes)))


def bad_pages(pages: np.ndarray, blocks: Sequence[int], generation: int) -> list[list[int]]:
    """[layer, block] of every page in `pages` [layers, len(blocks), page_bytes] that does
    not hold its content."""
    return [[layer, int(block)] for layer in range(pages.shape[0])
            for i, block in enumerate(blocks)
            if not page_ok(pages[layer, i], layer, int(block), generation)]


def top_k_blocks(step: int, blocks: int, k: int, seed: int = SCORE_SEED) -> np.ndarray:
    """The k block ids a decode step attends to: the best of seeded random scores (a
    stand-in for query-key relevance), highest score first; the same in every run."""
    if not 1 <= k <= blocks:
        raise ParamInvalid(f"top-k must be in 1..{blocks} (the blocks offloaded), got {k}")
    scores = np.random.default_rng([seed, step]).random(blocks)
    chosen = np.argpartition(scores, blocks - k)[blocks - k:]
    return chosen[np.argsort(-scores[chosen], kind="stable")]


class KvOffloadJob:
    """The symmetric objects of the scenario; every PE constructs it (collective)."""

    def __init__(self, ctx: ShmemContext, layout: KvLayout) -> None:
        if ctx.n_pes != layout.n_pes:
            raise ParamInvalid(f"the layout needs {layout.n_pes} PEs (PE 0 and "
                               f"{layout.pool_pes} pool PEs), the job has {ctx.n_pes}")
        self.ctx, self.layout = ctx, layout
        self.pool = ctx.create_tensor((layout.slots, layout.layers, layout.page_bytes),
                                      np.uint8, name="kv-pool")
        self.verdicts = ctx.create_tensor(ctx.n_pes, np.int64, name="kv-verdicts")
        self.offloaded = ctx.create_signal("kv-offloaded")  # PE 0 -> pool: generations
        self.checked = ctx.create_signal("kv-checked")      # pool -> PE 0: verdicts in
        self.finished = ctx.create_signal("kv-finished")    # PE 0 -> pool: leave now
        ctx.barrier_all()

    def pool_pes(self) -> range:
        return range(1, self.ctx.n_pes)


class InferenceSide:
    """PE 0: the paged "device" KV cache, its offload, and the top-k gathers."""

    def __init__(self, job: KvOffloadJob) -> None:
        if job.ctx.my_pe != INFERENCE_PE:
            raise ParamInvalid(f"the inference side runs on PE {INFERENCE_PE}")
        self.job, self.ctx, self.layout = job, job.ctx, job.layout
        layout = self.layout
        self.cache = np.zeros((layout.layers, layout.blocks, layout.page_bytes), np.uint8)
        self.generation = 0
        self._compact: np.ndarray | None = None

    def compute_layer(self, layer: int) -> None:
        """Stand-in for prefill computing one layer's KV: every block's page of it."""
        for block in range(self.layout.blocks):
            fill_page(self.cache[layer, block], layer, block, self.generation)

    def offload_pairs(self, layer: int) -> dict[int, list[tuple[object, np.ndarray]]]:
        """Pool PE -> [(pool page, cache page)] for every block of `layer`."""
        by_pe: dict[int, list[tuple[object, np.ndarray]]] = {}
        pool, cache = self.job.pool, self.cache
        for block in range(self.layout.blocks):
            pe, slot = self.layout.home(block)
            by_pe.setdefault(pe, []).append((pool[slot][layer], cache[layer, block]))
        return by_pe

    def offload_batches(self, layer: int) -> dict[int, ArrayBatch]:
        """Pool PE -> one ArrayBatch of every block's page of `layer` (what offload_pairs
        lists, as offset arrays: no Python work per page)."""
        layout, page = self.layout, self.layout.page_bytes
        out: dict[int, ArrayBatch] = {}
        for pe, blocks in self._shards().items():
            slots = blocks // layout.pool_pes
            out[pe] = ArrayBatch(self.job.pool, self.cache,
                                 (slots * layout.layers + layer) * page,
                                 (layer * layout.blocks + blocks) * page, page)
        return out

    def _shards(self) -> dict[int, np.ndarray]:
        """Pool PE -> the block ids it holds, in order."""
        blocks = np.arange(self.layout.blocks)
        homes = 1 + blocks % self.layout.pool_pes
        return {pe: blocks[homes == pe] for pe in self.job.pool_pes() if (homes == pe).any()}

    def offload_layer(self, layer: int, *, wait: bool = True) -> None:
        """One batched PUT per pool PE of this layer's pages (non-blocking: all pool
        PEs at once); `wait` completes them."""
        for pe, batch in self.offload_batches(layer).items():
            self.ctx.put_batch(batch, pe, nbi=True)
        if wait:
            self.ctx.quiet()

    def prefill(self, generation: int = 1) -> float:
        """Compute and offload every layer (layer l's PUT overlaps layer l+1's compute),
        then tell the pool PEs; returns the seconds it took."""
        start = time.perf_counter()
        self.generation = generation
        for layer in range(self.layout.layers):
            self.compute_layer(layer)
            self.offload_layer(layer, wait=False)
        self.ctx.quiet()
        elapsed = time.perf_counter() - start
        self.announce()
        return elapsed

    def announce(self) -> None:
        """Signal every pool PE that generation `self.generation` is offloaded."""
        for pe in self.job.pool_pes():
            self.ctx.signal(self.job.offloaded, self.generation, pe)

    def pool_verdicts(self, timeout: float | None = None) -> dict[int, int]:
        """Wait for every pool PE's check of this generation: pool PE -> bad pages."""
        want = self.generation * len(self.job.pool_pes())
        self.ctx.wait_until(self.job.checked, GE, want, timeout)
        return {pe: int(self.job.verdicts.local[pe]) for pe in self.job.pool_pes()}

    def compact(self, k: int) -> np.ndarray:
        """The compact buffer [layers, k, page_bytes] gathers land in (allocated once)."""
        shape = (self.layout.layers, k, self.layout.page_bytes)
        if self._compact is None or self._compact.shape != shape:
            self._compact = np.zeros(shape, np.uint8)
        return self._compact

    def gather_pairs(self, blocks: Sequence[int], into: np.ndarray
                     ) -> dict[int, list[tuple[np.ndarray, object]]]:
        """Pool PE -> [(compact page, pool page)] for every layer of every block."""
        by_pe: dict[int, list[tuple[np.ndarray, object]]] = {}
        pool = self.job.pool
        for i, block in enumerate(blocks):
            pe, slot = self.layout.home(int(block))
            pairs = by_pe.setdefault(pe, [])
            home = pool[slot]
            pairs.extend((into[layer, i], home[layer]) for layer in range(self.layout.layers))
        return by_pe

    def gather_batches(self, blocks: Sequence[int], into: np.ndarray) -> dict[int, ArrayBatch]:
        """Pool PE -> one ArrayBatch of every layer of its chosen blocks (gather_pairs as
        offset arrays), block by block: a block's pages, neighbours in the pool, follow
        each other, so they coalesce wherever `into` has them side by side too."""
        layout, page = self.layout, self.layout.page_bytes
        chosen = np.asarray(blocks, np.int64)
        k, layers = chosen.size, np.arange(layout.layers)
        homes = 1 + chosen % layout.pool_pes
        out: dict[int, ArrayBatch] = {}
        for pe in np.unique(homes).tolist():
            picks = np.flatnonzero(homes == pe)
            slots = chosen[picks] // layout.pool_pes
            src = ((slots[:, None] * layout.layers + layers[None, :]) * page).ravel()
            dst = ((layers[None, :] * k + picks[:, None]) * page).ravel()
            out[pe] = ArrayBatch(into, self.job.pool, dst, src, page)
        return out

    def gather(self, blocks: Sequence[int], into: np.ndarray) -> None:
        """One batched GET per pool PE, then quiet: all but the last in flight at once,
        the last one blocking (it runs while the others do, without a worker hand-off)."""
        batches = list(self.gather_batches(blocks, into).items())
        for pe, batch in batches[:-1]:
            self.ctx.get_batch(batch, pe, nbi=True)
        pe, batch = batches[-1]
        self.ctx.get_batch(batch, pe)
        self.ctx.quiet()

    def decode_step(self, step: int, k: int) -> tuple[np.ndarray, list[list[int]], float]:
        """Choose top-k blocks, gather them, check them: (blocks, bad [layer, block]
        pages, seconds the gather took)."""
        blocks = top_k_blocks(step, self.layout.blocks, k)
        into = self.compact(k)
        into.fill(0)  # a page the gather missed cannot pass as last step's
        start = time.perf_counter()
        self.gather(blocks, into)
        elapsed = time.perf_counter() - start
        return blocks, bad_pages(into, blocks, self.generation), elapsed

    def finish(self) -> None:
        """Let the pool PEs leave (they wait for this, not for a barrier's deadline)."""
        for pe in self.job.pool_pes():
            self.ctx.signal(self.job.finished, 1, pe)


class PoolSide:
    """A pool PE: holds its shard; checks each offloaded generation for PE 0."""

    def __init__(self, job: KvOffloadJob) -> None:
        if job.ctx.my_pe == INFERENCE_PE:
            raise ParamInvalid(f"PE {INFERENCE_PE} is the inference side, not a pool PE")
        self.job, self.ctx, self.layout = job, job.ctx, job.layout
        self.shard = [b for b in range(self.layout.blocks)
                      if self.layout.home(b)[0] == self.ctx.my_pe]

    def wait_offloaded(self, generation: int, timeout: float | None = None) -> None:
        self.ctx.wait_until(self.job.offloaded, GE, generation, timeout)

    def bad_pages(self, generation: int) -> list[list[int]]:
        """[layer, block] of every page of this shard that is not what PE 0 offloaded."""
        pool = self.job.pool.local
        return [[layer, block] for block in self.shard for layer in range(self.layout.layers)
                if not page_ok(pool[self.layout.home(block)[1], layer], layer, block,
                               generation)]

    def report(self, bad: int) -> None:
        """Put this PE's count of bad pages into PE 0's verdicts, then signal it."""
        mine = self.job.verdicts[self.ctx.my_pe]
        mine.local[...] = bad  # staged in the heap: put from there, nothing to register
        self.ctx.put(mine, mine, INFERENCE_PE)
        self.ctx.signal(self.job.checked, 1, INFERENCE_PE, "add")

    def serve(self, generation: int, timeout: float | None = None) -> list[list[int]]:
        """Wait for generation `generation`, check it, report; the bad pages."""
        self.wait_offloaded(generation, timeout)
        bad = self.bad_pages(generation)
        self.report(len(bad))
        return bad

    def wait_finished(self, timeout: float | None = None) -> None:
        self.ctx.wait_until(self.job.finished, GE, 1, timeout)


__all__ = ["INFERENCE_PE", "InferenceSide", "KvLayout", "KvOffloadJob", "PoolSide",
           "bad_pages", "fill_page", "page_ok", "top_k_blocks"]
