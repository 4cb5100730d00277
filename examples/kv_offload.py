"""Offload a paged KV cache to a host pool on another process, then gather the top-k
blocks back at every decode step — with hixl.shmem's batched one-sided PUT and GET.

    hixl shmem-run -n 2 -- python examples/kv_offload.py --layers 4 --blocks 64 \\
        --block-kib 144 --top-k 8 --steps 10

PE 0 plays the inference process: its "device" KV cache is `layers` x `blocks` pages of
`--block-kib` KiB (one block's K and V in one layer). PE 1 (and any further PE: the pool
is sharded by block id) is the host pool. Every page's bytes are a function of (layer,
block), so each side checks what it received without asking the other.
Add --tcp to move the bytes over TCP even on one node (same-node PEs otherwise map each
other's memory). The scenario's parts live in hixl.tools.kv_offload.
"""

from __future__ import annotations

import argparse
import os
import sys

import hixl.shmem as shmem
from hixl.errors import HixlError
from hixl.tools.kv_offload import INFERENCE_PE, InferenceSide, KvLayout, KvOffloadJob, PoolSide

MIB = 1 << 20


def inference(job: KvOffloadJob, args: argparse.Namespace) -> bool:
    """PE 0: prefill + offload, then decode steps that gather the top-k blocks."""
    side = InferenceSide(job)
    layout = job.layout
    # prefill: layer by layer, each layer's pages go out in one batched PUT per pool PE
    # while the next layer is computed; the pool PEs then check every page they got
    seconds = side.prefill(generation=1)
    print(f"prefill: offloaded {layout.blocks} blocks x {layout.layers} layers "
          f"({layout.blocks * layout.block_bytes / MIB:.1f} MiB) in {layout.layers} batched "
          f"puts per pool PE, {seconds * 1e3:.1f} ms")
    verdicts = side.pool_verdicts()
    print(f"pool PEs checked every offloaded page: bad pages per PE {verdicts}")
    ok = not any(verdicts.values())
    # decode: each step picks its top-k blocks and gathers only those, every layer, into
    # a compact [layers, k, page] buffer with one batched GET per pool PE
    for step in range(args.steps):
        blocks, bad, seconds = side.decode_step(step, args.top_k)
        nbytes = len(blocks) * layout.block_bytes
        verdict = "verified" if not bad else f"BAD pages [layer, block]: {bad[:8]}"
        print(f"step {step}: gathered blocks {blocks.tolist()} ({layout.layers * len(blocks)} "
              f"pages, {nbytes / MIB:.1f} MiB) in {seconds * 1e3:.2f} ms: {verdict}")
        ok = ok and not bad
    side.finish()  # the pool PEs may leave now
    print(f"done: {args.steps} steps, {args.steps * args.top_k} blocks gathered and "
          f"checked page for page: {'all correct' if ok else 'MISMATCHES'}")
    return ok


def pool(job: KvOffloadJob) -> bool:
    """A pool PE: hold the offloaded blocks, check them, serve the gathers (one-sided:
    nothing to do for them), leave when PE 0 is done."""
    side = PoolSide(job)
    bad = side.serve(generation=1)
    print(f"pool: holding {len(side.shard)} blocks x {job.layout.layers} layers; "
          f"{'all pages verified' if not bad else f'BAD pages: {bad[:8]}'}")
    side.wait_finished(timeout=3600)
    return not bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64, help="blocks in the KV cache")
    parser.add_argument("--block-kib", type=int, default=144,
                        help="KiB of one block in one layer (its K and V pages)")
    parser.add_argument("--top-k", type=int, default=8, help="blocks gathered per step")
    parser.add_argument("--steps", type=int, default=10, help="decode steps")
    parser.add_argument("--tcp", action="store_true", help="move bytes over TCP on one node")
    args = parser.parse_args()
    # `hixl shmem-run` tells every PE its number, the job's size and the bootstrap
    n_pes, me = int(os.environ["HIXL_SHMEM_N_PES"]), os.environ["HIXL_SHMEM_PE"]
    layout = KvLayout(args.layers, args.blocks, args.block_kib << 10, pool_pes=n_pes - 1)
    try:
        # every PE's heap must hold one pool shard (PE 0's copy is unused: see
        # hixl.tools.kv_offload); leaving the `with` finalizes (no barrier on an error)
        with shmem.init(heap_size=layout.heap_bytes, local_paths=not args.tcp) as ctx:
            job = KvOffloadJob(ctx, layout)  # collective: the pool tensor and signals
            if ctx.my_pe == INFERENCE_PE:
                print(f"KV cache: {layout.layers} layers x {layout.blocks} blocks x "
                      f"{args.block_kib} KiB; pool on PE(s) {list(job.pool_pes())} "
                      f"(route: {ctx.route(1)})")
            ok = inference(job, args) if ctx.my_pe == INFERENCE_PE else pool(job)
    except HixlError as exc:  # a typed error that names the PE concerned
        print(f"PE {me} failed: {type(exc).__name__}: {exc} (failed={exc.failed})",
              file=sys.stderr, flush=True)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
