"""Device memory figures of issue 21, one run, same-run ratios (a minute or two on a GPU).

    python scripts/gpu_bench.py                 # on a CUDA machine (scripts/gpu_check.sh)
    python scripts/gpu_bench.py --stand-in      # anywhere: host memory standing in

Prints, for 8784 KiB blocks (HIXL's KV-cache layer):
- mapped path: D2rH / rH2D through hixl (one device copy into / out of the peer agent's
  mapped segment) against a plain device <-> local pinned-host copy of the same size;
  issue 21's target is >= 0.9x.
- socket path (TCP over loopback: the agent serves no unix socket here): PUT / GET from
  device memory (through the staging ring) against the same transfers from host memory;
  target >= 0.9x. Both ends are on this machine, so this is loopback TCP, not two hosts.
- one 4 KiB D2rH op on the mapped path: p50 (and host -> remote host for context).

Figures are medians of per-call times after a warm-up; every transfer's bytes are checked
once. `--json FILE` writes them too. With `--stand-in` the "device" is host memory moved
by hixl.staging.HostStandIn (a smoke run of this script; its ratios say nothing of GPUs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hixl import Engine
from hixl.processes import DaemonProcess
from hixl.types import MemType, TransferOp, TransferOpDesc

KiB = 1 << 10
BLOCK = 8784 * KiB
SMALL = 4 * KiB


class Agent:
    """A hixl-agent process on loopback, TCP data port only (no unix socket)."""

    def __init__(self, pool_bytes: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="hixl-gpu-bench-")
        config = os.path.join(self.dir, "agent.yaml")
        with open(config, "w", encoding="utf-8") as f:
            f.write(f"host: 127.0.0.1\ngrpc_port: 0\ndata_port: 0\ndata_unix: false\n"
                    f"runtime_dir: {self.dir}/run\npool_max_bytes: {pool_bytes}\n"
                    f"state_dir: {self.dir}/state\nlog_level: WARNING\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
        self.process = DaemonProcess([sys.executable, "-m", "hixl.server.main", "--config", config],
                                     name="hixl-agent", ready="hixl-agent serving ", env=env,
                                     start_new_session=True)
        self.process.wait_ready()
        self.engine = self.process.ready_fields["engine"]

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def median_s(call: Callable[[], Any], iterations: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iterations):
        began = time.perf_counter_ns()
        call()
        times.append(time.perf_counter_ns() - began)
    return statistics.median(times) / 1e9


class Cuda:
    """Device buffers as CUDA tensors; the baseline copy is torch's to/from pinned host."""

    name = "cuda"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            sys.exit("gpu_bench: no CUDA device (use --stand-in for a smoke run)")
        self.torch = torch
        self.label = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"

    def engine(self, fabric: bool) -> Engine:
        return Engine("127.0.0.1", {"EnableUseFabricMem": "1" if fabric else "0"})

    def buffer(self, nbytes: int, seed: int) -> Any:
        gen = self.torch.Generator(device="cuda").manual_seed(seed)
        return self.torch.randint(0, 256, (nbytes,), dtype=self.torch.uint8, device="cuda",
                                  generator=gen)

    def register(self, engine: Engine, buf: Any) -> int:
        engine.register(buf)
        return buf.data_ptr()

    def host_bytes(self, buf: Any) -> np.ndarray:
        return buf.cpu().numpy()

    def baseline(self, nbytes: int, iterations: int) -> tuple[float, float]:
        """Seconds of a device -> pinned-host copy and back (median)."""
        torch = self.torch
        dev = self.buffer(nbytes, 7)
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()

        def d2h() -> None:
            pinned.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        def h2d() -> None:
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        return median_s(d2h, iterations), median_s(h2d, iterations)


class StandIn:
    """Host memory standing in for the device (hixl.staging.HostStandIn)."""

    name = "stand-in"
    label = "host memory standing in for a device (no GPU figures)"

    def __init__(self) -> None:
        from hixl.staging import HostStandIn

        self.copier = HostStandIn()

    def engine(self, fabric: bool) -> Engine:
        return Engine("127.0.0.1", {"EnableUseFabricMem": "1" if fabric else "0"},
                      device_copier=self.copier)

    def buffer(self, nbytes: int, seed: int) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)

    def register(self, engine: Engine, buf: np.ndarray) -> int:
        engine.register(buf, mem_type=MemType.MEM_DEVICE)
        return buf.ctypes.data

    def host_bytes(self, buf: np.ndarray) -> np.ndarray:
        return buf

    def baseline(self, nbytes: int, iterations: int) -> tuple[float, float]:
        src, dst = self.buffer(nbytes, 7), np.empty(nbytes, np.uint8)

        def copy() -> None:
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, nbytes)

        seconds = median_s(copy, iterations)
        return seconds, seconds


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds else 0.0


def measure(side: Any, agent: str, iterations: int) -> dict[str, Any]:
    out: dict[str, Any] = {"device": side.label, "block_bytes": BLOCK}
    d2h_s, h2d_s = side.baseline(BLOCK, iterations)
    out["baseline_d2h_gbps"], out["baseline_h2d_gbps"] = gbps(BLOCK, d2h_s), gbps(BLOCK, h2d_s)
    measure_path(side, agent, "mapped", True, iterations, out)
    measure_path(side, agent, "tcp", False, iterations, out)
    return out


def measure_path(side: Any, agent: str, path: str, fabric: bool, iterations: int,
                 out: dict[str, Any]) -> None:
    with side.engine(fabric) as engine:
        engine.connect(agent, timeout=10)
        segment = engine.allocate(agent, 2 * BLOCK)
        route = engine.route(agent, segment.base)
        expected = "fabric" if fabric else "tcp"
        if route != expected:
            raise RuntimeError(f"{path}: the route is {route!r}, not {expected!r} "
                               f"({route.reason})")
        src, back = side.buffer(BLOCK, 1), side.buffer(BLOCK, 2)
        src_addr, back_addr = side.register(engine, src), side.register(engine, back)
        check = np.zeros(BLOCK, np.uint8)
        engine.register(check)
        engine.write(agent, src_addr, segment.base, BLOCK, timeout=30)
        engine.read(agent, check, segment.base, timeout=30)
        if not np.array_equal(check, side.host_bytes(src)):
            raise RuntimeError(f"{path} D2rH: the remote bytes differ")
        engine.read(agent, back_addr, segment.base, BLOCK, timeout=30)
        if not np.array_equal(side.host_bytes(back), check):
            raise RuntimeError(f"{path} rH2D: the device bytes differ")
        put = median_s(lambda: engine.write(agent, src_addr, segment.base, BLOCK, 30.0),
                       iterations)
        get = median_s(lambda: engine.read(agent, back_addr, segment.base, BLOCK, 30.0),
                       iterations)
        out[f"{path}_d2rh_gbps"], out[f"{path}_rh2d_gbps"] = gbps(BLOCK, put), gbps(BLOCK, get)
        if fabric:
            small = median_s(lambda: engine.transfer(
                agent, TransferOp.WRITE, [TransferOpDesc(src_addr, segment.base, SMALL)],
                30.0), iterations * 20)
            out["mapped_4k_d2rh_p50_us"] = small * 1e6
            host = np.ones(SMALL, np.uint8)
            engine.register(host)
            out["mapped_4k_h2rh_p50_us"] = median_s(
                lambda: engine.write(agent, host, segment.base, timeout=30.0),
                iterations * 20) * 1e6
        else:
            host = np.ones(BLOCK, np.uint8)
            engine.register(host)
            out["tcp_host_put_gbps"] = gbps(BLOCK, median_s(
                lambda: engine.write(agent, host, segment.base, timeout=30.0), iterations))
            out["tcp_host_get_gbps"] = gbps(BLOCK, median_s(
                lambda: engine.read(agent, host, segment.base, timeout=30.0), iterations))
        engine.release(agent, segment)


def report(r: dict[str, Any]) -> list[str]:
    def line(what: str, value: float, base: float, base_name: str) -> str:
        ratio = value / base if base else 0.0
        verdict = "meets" if ratio >= 0.9 else "below"
        return (f"{what}: {value:.2f} GB/s vs {base_name} {base:.2f} GB/s = {ratio:.2f}x "
                f"({verdict} the 0.9x target)")

    return [
        f"gpu_bench: {r['device']}; {r['block_bytes'] // KiB} KiB blocks, medians",
        line("mapped D2rH", r["mapped_d2rh_gbps"], r["baseline_d2h_gbps"], "device->pinned copy"),
        line("mapped rH2D", r["mapped_rh2d_gbps"], r["baseline_h2d_gbps"], "pinned->device copy"),
        line("TCP PUT from device", r["tcp_d2rh_gbps"], r["tcp_host_put_gbps"], "TCP PUT from host"),
        line("TCP GET to device", r["tcp_rh2d_gbps"], r["tcp_host_get_gbps"], "TCP GET to host"),
        f"mapped 4 KiB D2rH op: p50 {r['mapped_4k_d2rh_p50_us']:.1f} us (host->remote host "
        f"4 KiB: {r['mapped_4k_h2rh_p50_us']:.1f} us)",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--stand-in", action="store_true",
                        help="host memory standing in for the device (no GPU needed)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    side = StandIn() if args.stand_in else Cuda()
    agent = Agent(pool_bytes=8 * BLOCK)
    try:
        result = measure(side, agent.engine, args.iterations)
    finally:
        agent.stop()
    print("\n".join(report(result)), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
