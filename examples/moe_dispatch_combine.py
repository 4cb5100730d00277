"""MoE dispatch and combine across processes with hixl.shmem, checked against one process.

    hixl shmem-run -n 2 -- python examples/moe_dispatch_combine.py \
        --tokens 128 --hidden 7168 --topk 8 --experts-per-pe 8

Every PE (process) holds `tokens` tokens and routes each to `topk` of the job's
n_pes * experts_per_pe experts. Dispatch sends each (token, k) row to the PE that owns its
expert — one put per destination PE, then a signal; that PE applies the expert; combine
sends every result back, and the token's owner sums its K results with the routing
weights. The output must equal, bit for bit, what a single process computes with the
same operations (hixl.tools.moe.reference_output); it is also compared with a float64
evaluation (within 1e-5 for float32, 1e-2 for float16: numpy has no bfloat16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import hixl.shmem as shmem
from hixl.errors import HixlError
from hixl.tools import moe


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per PE (Bs)")
    parser.add_argument("--hidden", type=int, default=7168, help="hidden size (H)")
    parser.add_argument("--topk", type=int, default=8, help="experts per token (K)")
    parser.add_argument("--experts-per-pe", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(moe.DTYPES), default="float32")
    parser.add_argument("--iterations", type=int, default=3, help="passes, fresh tokens each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-paths", choices=("on", "off"), default="on",
                        help="off: reach same-node PEs over TCP instead of mapping their heaps")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args()
    shape = moe.MoeShape(args.tokens, args.hidden, args.topk, args.experts_per_pe, args.dtype)

    # `hixl shmem-run` tells every PE its number, the job's size and the bootstrap; the
    # heap must hold the layer's buffers, which depend on the job's size
    n_pes = int(os.environ.get("HIXL_SHMEM_N_PES", "1"))
    ctx = shmem.init(heap_size=moe.heap_bytes(shape, n_pes),
                     local_paths=args.local_paths == "on")
    me = ctx.my_pe
    try:
        layer = moe.MoeLayer(ctx, shape, seed=args.seed)  # collective: every PE makes it
        routes = [ctx.route(pe) for pe in range(n_pes)]  # "self", "fabric", "unix" or "tcp"
        checks = []
        for iteration in range(args.iterations):
            inputs = moe.make_inputs(shape, n_pes, me, iteration, args.seed)
            # the three phases of layer.forward(inputs), spelled out
            dispatched = layer.dispatch(inputs.x, inputs.expert_ids)
            problems = moe.check_metadata(dispatched, shape, n_pes, me, iteration, args.seed)
            layer.compute(dispatched)
            out = layer.combine(dispatched, inputs.weights)
            check = moe.check_output(out, shape, n_pes, me, iteration, args.seed)
            checks.append({**check.as_dict(), "metadata_problems": problems})
        shmem.finalize()
    except HixlError as exc:  # a dead or misbehaving peer: a typed error, never a hang
        print(f"PE {me}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        ctx.finalize(barrier=False)
        return 1

    ok = all(c["ok"] and not c["metadata_problems"] for c in checks)
    worst = max(c["max_abs_err"] for c in checks)
    if args.json:
        print(json.dumps({"pe": me, "n_pes": n_pes, "shape": str(shape), "ok": ok,
                          "routes": routes, "checks": checks}), flush=True)
    else:
        verdict = "equals the single-process reference exactly" if ok else "MISMATCH"
        print(f"PE {me}/{n_pes}: {shape}, {args.iterations} passes: output {verdict}; "
              f"max |out - float64| = {worst:.2e} (tolerance {moe.TOLERANCE[shape.dtype]:g})",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
