"""One hixl.shmem PE in its own process, running a scenario for tests/test_shmem*.py.

    python shmem_worker.py '{"scenario": "core", "pe": 0, "n_pes": 4,
                             "bootstrap": "127.0.0.1:50051", "job": "j1", "heap": "16MiB",
                             "lease_ttl_ms": 1000, "local_paths": true, "timeout": 20}'

It prints JSON lines: {"event": "ready"} where a scenario waits for the test to act
(e.g. kill a PE), then one final line: {"result": {...}} with what it checked, or
{"error": ClassName, "message", "failed"} when the scenario raised. Every byte moved is
compared in the worker against pattern(seed) (the same bytes in every process), so only
verdicts cross the pipe.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

import hixl.shmem as shmem
from hixl.errors import HixlError

CHUNK = 64 << 10          # per-sender row of the inboxes
BIG = 8 << 20             # put-then-signal payload: large, so a broken ordering shows
ROUNDS = 6
BARRIER_ROUNDS = 50


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def seed(kind: int, sender: int, target: int) -> int:
    return kind * 10_000 + sender * 100 + target


def emit(message: dict[str, Any]) -> None:
    print(json.dumps(message), flush=True)


def error_of(exc: BaseException) -> dict[str, Any]:
    return {"error": type(exc).__name__, "message": str(exc),
            "failed": list(getattr(exc, "failed", []))}


def expect_error(call: Any) -> dict[str, Any]:
    """Run `call`, which must raise a HixlError; its class name, message and .failed."""
    try:
        call()
    except HixlError as exc:
        return error_of(exc)
    return {"error": None}


def options(job: dict[str, Any]) -> dict[str, Any]:
    """init's keywords; without "job" the id comes from the bootstrap or $HIXL_SHMEM_JOB."""
    chosen = {"job": job["job"]} if "job" in job else {}
    return {**chosen, "timeout": job.get("timeout", 20.0),
            "lease_ttl_ms": job.get("lease_ttl_ms", 1000),
            "local_paths": job.get("local_paths", True)}


def core(job: dict[str, Any]) -> dict[str, Any]:
    """The module-level API end to end, every byte checked."""
    ctx = shmem.init(job["pe"], job["n_pes"], job["bootstrap"], job.get("heap", "16MiB"),
                     **options(job))
    me, n = shmem.my_pe(), shmem.n_pes()
    right, left = (me + 1) % n, (me - 1) % n
    out: dict[str, Any] = {"pe": me, "n_pes": n,
                           "routes": {str(t): ctx.route(t) for t in range(n)}}
    inbox = shmem.create_tensor((n, CHUNK), np.uint8, name="inbox")
    inbox2 = shmem.create_tensor((n, CHUNK), np.uint8, name="inbox2")
    tensor = shmem.create_tensor((4, 8), np.float64, name="tensor")
    big = shmem.malloc(BIG, name="big")
    sig_add, sig_set = shmem.create_signal("add"), shmem.create_signal("set")
    sig_data, sig_ack = shmem.create_signal("data"), shmem.create_signal("ack")
    cells = shmem.create_tensor(n, np.int64, name="cells")
    objects = [inbox, inbox2, tensor, big, sig_add, sig_set, sig_data, sig_ack, cells]
    out["offsets"] = [obj.offset for obj in objects]

    # blocking put of row `me` into every PE (itself too), then check every row here
    for t in range(n):
        shmem.put(inbox[me], pattern(seed(1, me, t), CHUNK), t)
    shmem.barrier_all()
    out["put_bad_rows"] = [j for j in range(n)
                           if not np.array_equal(inbox.local[j], pattern(seed(1, j, me), CHUNK))]
    # blocking get of every PE's whole inbox into memory outside the heap
    out["get_bad"] = []
    for t in range(n):
        local = np.zeros((n, CHUNK), np.uint8)
        shmem.get(local, inbox, t)
        out["get_bad"] += [[t, j] for j in range(n)
                           if not np.array_equal(local[j], pattern(seed(1, j, t), CHUNK))]
    # non-blocking puts (dst given as a numpy view of the heap), quiet, barrier, check
    sources = [pattern(seed(2, me, t), CHUNK) for t in range(n)]
    for t in range(n):
        shmem.put_nbi(inbox2.local[me], sources[t], t)
    shmem.quiet()
    shmem.barrier_all()
    out["put_nbi_bad_rows"] = [
        j for j in range(n) if not np.array_equal(inbox2.local[j], pattern(seed(2, j, me), CHUNK))]
    landing = [np.zeros((n, CHUNK), np.uint8) for _ in range(n)]
    for t in range(n):
        shmem.get_nbi(landing[t], inbox2, t)
    shmem.quiet()
    out["get_nbi_bad"] = [[t, j] for t in range(n) for j in range(n)
                          if not np.array_equal(landing[t][j], pattern(seed(2, j, t), CHUNK))]

    # tensors: numpy views of the local copy; whole and row gets from every PE
    tensor.local[:] = np.arange(32, dtype=np.float64).reshape(4, 8) + 100 * me
    shmem.barrier_all()
    out["tensor"] = {"shape": list(tensor.local.shape), "dtype": str(tensor.local.dtype),
                     "row_shape": list(tensor[2].shape), "bad": []}
    for t in range(n):
        whole, row = np.zeros((4, 8)), np.zeros(8)
        shmem.get(whole, tensor, t)
        shmem.get(row, tensor[2], t)
        expected = np.arange(32, dtype=np.float64).reshape(4, 8) + 100 * t
        if not (np.array_equal(whole, expected) and np.array_equal(row, expected[2])):
            out["tensor"]["bad"].append(t)

    # ADD from every PE to every PE, three times each: the sum of all senders' slots
    for _ in range(3):
        for t in range(n):
            shmem.signal(sig_add, me + 1, t, shmem.ADD)
    expected_sum = 3 * n * (n + 1) // 2
    out["add_seen"] = shmem.wait_until(sig_add, shmem.GE, expected_sum)
    shmem.barrier_all()
    out["add_final"], out["add_expected"] = shmem.signal_fetch(sig_add), expected_sum
    # SET from the last PE: 42, then 7 (replaces); the others never touch this signal
    if me == n - 1:
        for t in range(n):
            shmem.signal(sig_set, 42, t, "set")
            shmem.signal(sig_set, 7, t, shmem.SET)
    out["set_seen"] = shmem.wait_until(sig_set, "eq", 7)

    # put (blocking and nbi, alternating) then signal, to the right neighbour: the
    # receiver checks the 8 MiB the moment it sees the signal (the tail first: a copy
    # still under way shows there), then acks
    out["order_bad_rounds"] = []
    for r in range(ROUNDS):
        payload, expected = pattern(seed(3, me, r), BIG), pattern(seed(3, left, r), BIG)
        if r % 2:
            shmem.put_nbi(big, payload, right)
        else:
            shmem.put(big, payload, right)
        shmem.signal(sig_data, 1, right, shmem.ADD)
        shmem.wait_until(sig_data, shmem.GE, r + 1)
        tail_ok = np.array_equal(big.local[-CHUNK:], expected[-CHUNK:])
        if not (tail_ok and np.array_equal(big.local, expected)):
            out["order_bad_rounds"].append(r)
        shmem.signal(sig_ack, 1, left, shmem.ADD)
        shmem.wait_until(sig_ack, shmem.GE, r + 1)   # the right one read mine: reuse big

    # barriers, repeatedly: a put before a barrier is visible after it
    out["barrier_bad"] = []
    for i in range(1, BARRIER_ROUNDS + 1):
        shmem.put(cells[me], np.array(i, dtype=np.int64), right)
        shmem.barrier_all()
        if cells.local[left] != i:
            out["barrier_bad"].append(i)
        shmem.barrier_all()

    # heap exhaustion is a typed error and changes nothing: the next malloc still agrees
    out["exhausted"] = expect_error(lambda: shmem.malloc(BIG * 4))
    out["after_exhausted_offset"] = shmem.malloc(64).offset
    shmem.clear(inbox)
    out["cleared"] = bool(not inbox.local.any() and inbox2.local.any())
    shmem.finalize()
    shmem.finalize()  # idempotent
    out["finalized"] = expect_error(lambda: shmem.put(inbox, b"x", 0))
    return out


def errors(job: dict[str, Any]) -> dict[str, Any]:
    """Bad arguments and timeouts: typed errors naming the problem, the job still usable."""
    out: dict[str, Any] = {"pe": job["pe"]}
    with shmem.ShmemContext(job["pe"], job["n_pes"], job["bootstrap"], "1MiB",
                            **options(job)) as ctx:
        n = ctx.n_pes
        obj = ctx.malloc(64, name="obj")
        sig = ctx.create_signal("never")
        out["pe_high"] = expect_error(lambda: ctx.put(obj, np.zeros(8, np.uint8), n))
        out["pe_negative"] = expect_error(lambda: ctx.get(np.zeros(8, np.uint8), obj, -1))
        out["put_overflow"] = expect_error(lambda: ctx.put(obj, np.zeros(65, np.uint8), 1))
        out["get_overflow"] = expect_error(lambda: ctx.get(np.zeros(65, np.uint8), obj, 1))
        out["slice_overflow"] = expect_error(lambda: ctx.put(obj[60:], np.zeros(8, np.uint8), 1))
        out["not_symmetric"] = expect_error(
            lambda: ctx.put(np.zeros(8, np.uint8), np.zeros(8, np.uint8), 1))
        out["readonly_dst"] = expect_error(
            lambda: ctx.get(np.frombuffer(b"12345678", np.uint8), obj, 1))
        out["bad_cmp"] = expect_error(lambda: ctx.wait_until(sig, "bogus", 1))
        out["bad_op"] = expect_error(lambda: ctx.signal(sig, 1, 0, "xor"))
        out["not_signal"] = expect_error(lambda: ctx.signal(obj, 1, 0))
        out["signal_too_big"] = expect_error(lambda: ctx.signal(sig, 1 << 64, 0))
        out["malloc_zero"] = expect_error(lambda: ctx.malloc(0))
        out["bad_shape"] = expect_error(lambda: ctx.create_tensor((2, -1), np.int32))
        out["bad_dtype"] = expect_error(lambda: ctx.create_tensor((2,), object))
        out["wait_timeout"] = expect_error(lambda: ctx.wait_until(sig, shmem.EQ, 5, timeout=0.3))
        # an asymmetric malloc is caught at the next barrier on every PE; once the other
        # PE makes the same call the sequences agree again
        if ctx.my_pe == 0:
            ctx.malloc(128)
        out["asymmetric"] = expect_error(ctx.barrier_all)
        if ctx.my_pe != 0:
            ctx.malloc(128)
        ctx.barrier_all()
        # still usable after all that: a put and a get with every byte checked
        peer = (ctx.my_pe + 1) % n
        ctx.put(obj, pattern(seed(4, ctx.my_pe, peer), 64), peer)
        ctx.barrier_all()
        back = np.zeros(64, np.uint8)
        ctx.get(back, obj, peer)
        out["still_works"] = bool(
            np.array_equal(obj.local, pattern(seed(4, (ctx.my_pe - 1) % n, ctx.my_pe), 64))
            and np.array_equal(back, pattern(seed(4, ctx.my_pe, peer), 64)))
    return out


def wait_for_victim(job: dict[str, Any]) -> dict[str, Any]:
    """Every PE but the victim waits on a signal nobody sends; the test kills the victim."""
    ctx = shmem.ShmemContext(job["pe"], job["n_pes"], job["bootstrap"], "1MiB",
                             **options(job))
    sig = ctx.create_signal("from-victim")
    box = ctx.malloc(4096)
    ctx.barrier_all()
    emit({"event": "ready"})
    if ctx.my_pe == job["victim"]:
        time.sleep(600)  # until SIGKILL
    started = time.monotonic()
    try:
        ctx.wait_until(sig, shmem.GE, 1, timeout=job["wait_timeout"])
        outcome: dict[str, Any] = {"error": None}
    except HixlError as exc:
        outcome = error_of(exc)
    outcome["waited_s"] = time.monotonic() - started  # reported, never asserted
    outcome["put_after"] = expect_error(
        lambda: ctx.put(box, np.ones(4096, np.uint8), job["victim"], timeout=5))
    ctx.finalize(barrier=False)
    return outcome


BATCH_ROWS, BATCH_ROW = 40, 4160  # odd-sized rows: no pair is page-aligned


def batch(job: dict[str, Any]) -> dict[str, Any]:
    """put_batch/get_batch: many pairs per call to every PE (itself too), blocking and
    nbi, local sides as views of one array; bad pairs raise naming the pair, nothing moved."""
    out: dict[str, Any] = {"pe": job["pe"]}
    with shmem.ShmemContext(job["pe"], job["n_pes"], job["bootstrap"], "8MiB",
                            **options(job)) as ctx:
        n, me = ctx.n_pes, ctx.my_pe
        shape = (n, BATCH_ROWS, BATCH_ROW)
        box, box_nbi, untouched = (ctx.create_tensor(shape, np.uint8, name=name)
                                   for name in ("box", "box-nbi", "untouched"))
        order = np.random.default_rng(me).permutation(BATCH_ROWS)  # pairs in any order

        def rows(kind: int, sender: int, target: int) -> np.ndarray:
            return pattern(seed(kind, sender, target), BATCH_ROWS * BATCH_ROW).reshape(
                BATCH_ROWS, BATCH_ROW)

        def lengths(r: int) -> int:  # nbi rows are partial: pairs of many sizes
            return 1 + (r * 997) % BATCH_ROW

        sources = {t: (rows(5, me, t), rows(6, me, t)) for t in range(n)}
        registrations = len(ctx._cache)
        for t in range(n):
            whole, partial = sources[t]
            ctx.put_batch([(box[me][int(r)], whole[r]) for r in order], t)
            ctx.put_batch([(box_nbi[me][int(r)], partial[r][:lengths(r)]) for r in order], t,
                          nbi=True)
        # 2 local arrays per target, each passed as 40 row views: one registration each
        out["registrations_added"] = len(ctx._cache) - registrations
        ctx.quiet()
        ctx.barrier_all()
        out["put_bad"] = [j for j in range(n) if not np.array_equal(box.local[j], rows(5, j, me))]
        out["put_nbi_bad"] = [
            [j, r] for j in range(n) for r in range(BATCH_ROWS)
            if not (np.array_equal(box_nbi.local[j, r, :lengths(r)], rows(6, j, me)[r, :lengths(r)])
                    and not box_nbi.local[j, r, lengths(r):].any())]
        out["get_bad"], out["get_nbi_bad"] = [], []
        for t in range(n):
            landing, landing_nbi = np.zeros(shape, np.uint8), np.zeros(shape, np.uint8)
            cells = [(j, int(r)) for j in range(n) for r in order]
            ctx.get_batch([(landing[j, r], box[j][r]) for j, r in cells], t)
            ctx.get_batch([(landing_nbi[j, r], box_nbi[j][r]) for j, r in cells], t, nbi=True)
            ctx.quiet()
            out["get_bad"] += [[t, j] for j in range(n)
                               if not np.array_equal(landing[j], rows(5, j, t))]
            out["get_nbi_bad"] += [[t, j] for j in range(n)
                                   if not np.array_equal(landing_nbi[j], box_nbi_expected(
                                       rows(6, j, t), lengths))]
        # bad pairs: the valid pairs before them must not move either
        right = (me + 1) % n
        good = [(untouched[me][r], sources[right][0][r]) for r in range(BATCH_ROWS - 1)]
        out["overflow"] = expect_error(lambda: ctx.put_batch(
            [*good, (untouched[me][BATCH_ROWS - 1], np.ones(BATCH_ROW + 1, np.uint8))], right))
        out["not_symmetric"] = expect_error(lambda: ctx.put_batch(
            [*good, (np.zeros(8, np.uint8), np.zeros(8, np.uint8))], right, nbi=True))
        out["not_a_pair"] = expect_error(lambda: ctx.put_batch([*good, (untouched[me][0],)],
                                                              right))
        out["not_a_list"] = expect_error(lambda: ctx.get_batch(b"pairs", right))
        landing = np.zeros((BATCH_ROWS, BATCH_ROW), np.uint8)
        readonly = np.frombuffer(bytes(BATCH_ROW), np.uint8)
        out["readonly_dst"] = expect_error(lambda: ctx.get_batch(
            [*[(landing[r], box[me][r]) for r in range(3)], (readonly, box[me][3])], right))
        out["get_overrun"] = expect_error(lambda: ctx.get_batch(
            [(landing[0], box[me][0]), (np.zeros(BATCH_ROW * 2, np.uint8), box[me][1])], right))
        out["bad_pe"] = expect_error(lambda: ctx.put_batch(good, n))
        ctx.put_batch([], right)  # nothing to move: a no-op
        ctx.barrier_all()
        out["nothing_moved"] = bool(not untouched.local.any() and not landing.any())
    return out


def array_batch(job: dict[str, Any]) -> dict[str, Any]:
    """put_batch/get_batch with an ArrayBatch (offset arrays) to every PE, itself too,
    blocking and nbi; rows in a shuffled order with a run of neighbours (coalesced);
    bad arrays raise naming the first bad move, nothing moved."""
    out: dict[str, Any] = {"pe": job["pe"]}
    with shmem.ShmemContext(job["pe"], job["n_pes"], job["bootstrap"], "8MiB",
                            **options(job)) as ctx:
        n, me = ctx.n_pes, ctx.my_pe
        shape = (n, BATCH_ROWS, BATCH_ROW)
        box, box_nbi, untouched = (ctx.create_tensor(shape, np.uint8, name=name)
                                   for name in ("box", "box-nbi", "untouched"))
        rng = np.random.default_rng(me)
        order = np.concatenate([np.arange(10, 20), rng.permutation(
            np.setdiff1d(np.arange(BATCH_ROWS), np.arange(10, 20)))])
        partial = np.array([1 + (r * 997) % BATCH_ROW for r in range(BATCH_ROWS)])

        def rows(kind: int, sender: int, target: int) -> np.ndarray:
            return pattern(seed(kind, sender, target), BATCH_ROWS * BATCH_ROW).reshape(
                BATCH_ROWS, BATCH_ROW)

        sources = {t: (rows(7, me, t), rows(8, me, t)) for t in range(n)}
        at = order * BATCH_ROW
        for t in range(n):
            whole, part = sources[t]
            ctx.put_batch(shmem.ArrayBatch(box[me], whole, at, at, BATCH_ROW), t)
            ctx.put_batch(shmem.ArrayBatch(box_nbi[me], part, at, at, partial[order]), t,
                          nbi=True)
        ctx.quiet()
        ctx.barrier_all()
        out["put_bad"] = [j for j in range(n) if not np.array_equal(box.local[j], rows(7, j, me))]
        out["put_nbi_bad"] = [j for j in range(n) if not np.array_equal(
            box_nbi.local[j], box_nbi_expected(rows(8, j, me), lambda r: partial[r]))]
        out["get_bad"] = []
        cells = (np.arange(n)[:, None] * BATCH_ROWS + order[None, :]).ravel() * BATCH_ROW
        for t in range(n):
            landing = np.zeros(shape, np.uint8)
            ctx.get_batch(shmem.ArrayBatch(landing, box, cells, cells, BATCH_ROW), t,
                          nbi=t % 2 == 1)
            ctx.quiet()
            out["get_bad"] += [[t, j] for j in range(n)
                               if not np.array_equal(landing[j], rows(7, j, t))]
        right = (me + 1) % n
        # a valid batch whose highest start plus its longest move passes the object's end
        # (the last 8 bytes, and a whole row from 0): checked move by move, then moved
        tail = BATCH_ROWS * BATCH_ROW - 8
        edge = np.zeros(BATCH_ROW + 8, np.uint8)
        ctx.get_batch(shmem.ArrayBatch(edge, box[me], [0, BATCH_ROW], [0, tail], [BATCH_ROW, 8]),
                      right)
        held = rows(7, me, right).ravel()
        out["edge_bad"] = not np.array_equal(edge, np.concatenate([held[:BATCH_ROW],
                                                                   held[tail:]]))
        src = sources[right][0]
        good = np.arange(BATCH_ROWS) * BATCH_ROW

        def refused(dst_at: Any, src_at: Any, lengths: Any, nbi: bool = False) -> dict[str, Any]:
            return expect_error(lambda: ctx.put_batch(
                shmem.ArrayBatch(untouched[me], src, dst_at, src_at, lengths), right, nbi=nbi))

        def with_at(array: np.ndarray, index: int, value: int) -> np.ndarray:
            changed = np.array(array)
            changed[index] = value
            return changed

        out["unequal"] = refused(good, good[:-1], BATCH_ROW)
        out["float"] = refused(good, good, np.full(BATCH_ROWS, 1.0 * BATCH_ROW))
        out["negative"] = refused(good, good, with_at(np.full(BATCH_ROWS, BATCH_ROW), 3, -1))
        out["dst_outside"] = refused(with_at(good, 25, BATCH_ROWS * BATCH_ROW - 10), good,
                                     BATCH_ROW, nbi=True)
        out["src_outside"] = refused(good, with_at(good, 7, src.nbytes), BATCH_ROW)
        out["not_symmetric"] = expect_error(lambda: ctx.put_batch(
            shmem.ArrayBatch(np.zeros(8, np.uint8), src, [0], [0], 8), right))
        ctx.put_batch(shmem.ArrayBatch(untouched[me], src, good[:0], good[:0], 8), right)
        ctx.put_batch(shmem.ArrayBatch(untouched[me], src, good, good, 0), right)  # all empty
        ctx.barrier_all()
        out["nothing_moved"] = bool(not untouched.local.any())
    return out


def box_nbi_expected(full: np.ndarray, lengths: Any) -> np.ndarray:
    """What box-nbi holds for one sender: each row's first lengths(r) bytes, zeros after."""
    expected = np.zeros_like(full)
    for r in range(full.shape[0]):
        expected[r, :lengths(r)] = full[r, :lengths(r)]
    return expected


def init_only(job: dict[str, Any]) -> dict[str, Any]:
    """init, and nothing else: for init's own failures (missing PEs)."""
    with shmem.ShmemContext(job["pe"], job["n_pes"], job["bootstrap"], "1MiB",
                            **options(job)) as ctx:
        return {"engine": ctx.engine.name, "job": ctx.job,
                "peers": [ctx.engine_of(t) for t in range(ctx.n_pes)]}


@contextlib.contextmanager
def gil_churn() -> Iterator[None]:
    """A busy thread and a tiny GIL switch interval: this process's main thread is then
    preempted between almost any two bytecodes, for as long as the OS takes to hand the
    GIL back. Load, not a mock: it widens every window between two reads of a waiter."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(64))

    interval = sys.getswitchinterval()
    busy = threading.Thread(target=spin, daemon=True)
    sys.setswitchinterval(1e-5)
    busy.start()
    try:
        yield
    finally:
        stop.set()
        busy.join()
        sys.setswitchinterval(interval)


def last_barrier(job: dict[str, Any]) -> dict[str, Any]:
    """The last-barrier race, round after round (a fresh job each): PE `last` enters
    finalize's barrier last (it first puts to every PE), so every PE gets through it at
    about once and leaves at once, while the others may still be between two reads of
    the same barrier. They run niced and under GIL churn, so they are often preempted
    right there. Every PE goes through every round, whatever failed before (the rounds
    are independent jobs): the result lists each (round, error, message) seen."""
    me, n = job["pe"], job["n_pes"]
    if me != job["last"]:
        os.nice(10)  # the OS hands them the CPU back late: the departing PE runs first
    failures: list[list[Any]] = []
    for round_ in range(job["rounds"]):
        try:
            ctx = shmem.ShmemContext(me, n, job["bootstrap"], "1MiB",
                                     **{**options(job), "job": f"{job['job']}-{round_}"})
        except HixlError as exc:
            failures.append([round_, type(exc).__name__, str(exc)])
            continue
        try:
            box = ctx.malloc(256 << 10)
            if me == job["last"]:
                for t in range(n):
                    ctx.put(box, pattern(seed(7, me, t), 256 << 10), t)
                ctx.finalize()
            else:
                with gil_churn():
                    ctx.finalize()
        except HixlError as exc:
            failures.append([round_, type(exc).__name__, str(exc)])
        finally:
            ctx.finalize(barrier=False)
    return {"rounds": job["rounds"], "failures": failures}


def finalize_early(job: dict[str, Any]) -> dict[str, Any]:
    """PE `early` finalizes (barrier=False) right after init, skipping the barrier the
    others then enter: `when` "before" they enter it (they start once its engine has left
    their global table, so their barrier writes to it fail), or "during" it (it leaves
    once every other PE's epoch of that barrier has reached it). The others report what
    their barrier raised: it must be PeerUnavailable naming it, however long the deadline."""
    ctx = shmem.ShmemContext(job["pe"], job["n_pes"], job["bootstrap"], "1MiB",
                             **options(job))
    me, n, early = ctx.my_pe, ctx.n_pes, job["early"]
    if me == early:
        if job["when"] == "during":
            epochs = ctx._words(ctx._barrier_at, n)  # this PE's slots of the others' epochs
            while any(epochs[pe] < 2 for pe in range(n) if pe != early):
                time.sleep(1e-3)
        ctx.finalize(barrier=False)
        return {"error": None}
    if job["when"] == "before":
        table, engine = ctx.engine.global_table, ctx.engine_of(early)
        if not table.wait_for(lambda seen: seen.view(engine) is None, job["barrier_timeout"]):
            return {"error": "setup: PE early never left the global table"}
    outcome = expect_error(lambda: ctx.barrier_all(timeout=job["barrier_timeout"]))
    ctx.finalize(barrier=False)
    return outcome


SCENARIOS = {"core": core, "errors": errors, "wait_for_victim": wait_for_victim,
             "init_only": init_only, "batch": batch, "array_batch": array_batch, "last_barrier": last_barrier,
             "finalize_early": finalize_early}


def main() -> None:
    job = json.loads(sys.argv[1])
    try:
        emit({"result": SCENARIOS[job["scenario"]](job)})
    except HixlError as exc:
        emit(error_of(exc))


if __name__ == "__main__":
    main()
