"""hixl.shmem on one node: a real hixl-master, every PE a real process
(tests/helpers/shmem_worker.py), every byte compared in the PEs against known patterns.

Same-node PEs take the mapped (fabric) path; with local_paths=False they reach each
other over TCP, where a large put is striped over several connections — the case where
a signal could overtake its payload if ordering relied on stream order.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal as signals
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest

import hixl.shmem as shmem
from hixl.errors import NotConnected, ParamInvalid
from hixl.processes import DaemonProcess
from hixl.tools.daemons import MasterProcess

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers", "shmem_worker.py")
GIVE_UP_S = 90.0  # only guards against a hang; never a performance bound


class PeProcess:
    """One PE: the worker script in a process of its own (or on a simulated host)."""

    def __init__(self, job: dict[str, Any],
                 spawn: Callable[..., subprocess.Popen[str]] = subprocess.Popen,
                 log_dir: str | None = None, env: dict[str, str] | None = None) -> None:
        self.job = job
        fd, self.log_path = tempfile.mkstemp(prefix=f"shmem-pe{job['pe']}-", suffix=".log",
                                             dir=log_dir)
        os.close(fd)
        self.process = DaemonProcess([sys.executable, WORKER, json.dumps(job)],
                                     name=f"PE {job['pe']}", log_path=self.log_path,
                                     lines=True, spawn=spawn,
                                     env={**os.environ, **env} if env else None)
        self.proc = self.process.proc

    def log(self) -> str:
        return self.process.log()[-6000:]

    def line(self, give_up: float = GIVE_UP_S) -> dict[str, Any]:
        """The next JSON line it prints; fails the test (with its log) if none comes."""
        deadline = time.monotonic() + give_up
        while text := self.process.next_line(deadline - time.monotonic()):
            if text.startswith("{"):
                return json.loads(text)
        pytest.fail(f"PE {self.job['pe']} gave no answer (rc={self.proc.poll()}); "
                    f"its log:\n{self.log()}")

    def result(self) -> dict[str, Any]:
        """Its scenario's result; fails the test with its error and log otherwise."""
        reply = self.line()
        assert "result" in reply, f"PE {self.job['pe']} failed: {reply}\n{self.log()}"
        return reply["result"]

    def close(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.kill()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    with MasterProcess() as master:
        yield master


@pytest.fixture
def pes(master: MasterProcess) -> Iterator[Callable[..., list[PeProcess]]]:
    """Factory: start PEs `pes` (default all of 0..n_pes-1) of a new job, running `scenario`."""
    started: list[PeProcess] = []

    def start(scenario: str, n_pes: int, pes: Sequence[int] | None = None,
              env: dict[str, str] | None = None, **fields: Any) -> list[PeProcess]:
        fields.setdefault("job", f"{scenario}-{uuid.uuid4().hex[:8]}")  # None: init's default
        fields.setdefault("bootstrap", master.target)
        procs = [PeProcess({"scenario": scenario, "pe": pe, "n_pes": n_pes, **fields}, env=env)
                 for pe in (range(n_pes) if pes is None else pes)]
        started.extend(procs)
        return procs

    yield start
    for proc in started:
        proc.close()


def check_core(results: list[dict[str, Any]], path: Callable[[int, int], str]) -> None:
    """What the core scenario reports, on every PE: agreement, the data path `path(me,
    t)` to each PE, and every byte right."""
    n = len(results)
    assert [r["pe"] for r in results] == list(range(n))
    assert len({tuple(r["offsets"]) for r in results}) == 1, [r["offsets"] for r in results]
    assert len({r["after_exhausted_offset"] for r in results}) == 1
    for r in results:
        me = r["pe"]
        assert r["routes"] == {str(t): "self" if t == me else path(me, t) for t in range(n)}
        for key in ("put_bad_rows", "get_bad", "put_nbi_bad_rows", "get_nbi_bad",
                    "order_bad_rounds", "barrier_bad"):
            assert r[key] == [], (me, key, r[key])
        assert r["tensor"] == {"shape": [4, 8], "dtype": "float64", "row_shape": [8], "bad": []}
        assert r["add_seen"] == r["add_final"] == r["add_expected"] == 3 * n * (n + 1) // 2
        assert r["set_seen"] == 7
        assert r["exhausted"]["error"] == "ResourceExhausted"
        assert "symmetric heap exhausted" in r["exhausted"]["message"]
        assert r["cleared"] is True
        assert r["finalized"]["error"] == "NotConnected"


@pytest.mark.parametrize(("n_pes", "local_paths", "path"),
                         [(2, True, "fabric"), (4, True, "fabric"), (2, False, "tcp")],
                         ids=["2pes-mapped", "4pes-mapped", "2pes-tcp"])
def test_symmetric_heap_put_get_signals_and_barriers(pes, n_pes: int, local_paths: bool,
                                                     path: str) -> None:
    procs = pes("core", n_pes, local_paths=local_paths)
    check_core([proc.result() for proc in procs], lambda me, t: path)


def expect(result: dict[str, Any], key: str, cls: str, *words: str) -> None:
    """The worker's step `key` raised `cls` with every one of `words` in its message."""
    got = result[key]
    assert got["error"] == cls, (key, got)
    for word in words:
        assert word in got["message"], (key, word, got)


def test_bad_arguments_and_timeouts_raise_typed_errors_naming_the_problem(pes) -> None:
    for result in [proc.result() for proc in pes("errors", 2)]:
        expect(result, "pe_high", "ParamInvalid", "pe 2 is out of range", "2 PEs")
        expect(result, "pe_negative", "ParamInvalid", "pe -1 is out of range")
        expect(result, "put_overflow", "OutOfRange", "65 bytes", "64 bytes")
        expect(result, "get_overflow", "OutOfRange", "65 bytes", "64 bytes")
        expect(result, "slice_overflow", "OutOfRange", "8 bytes", "4 bytes")
        expect(result, "not_symmetric", "ParamInvalid", "not symmetric")
        expect(result, "readonly_dst", "ParamInvalid", "read-only")
        expect(result, "bad_cmp", "ParamInvalid", "cmp", "'bogus'")
        expect(result, "bad_op", "ParamInvalid", "'xor'")
        expect(result, "not_signal", "ParamInvalid", "create_signal")
        expect(result, "signal_too_big", "ParamInvalid", "64-bit")
        expect(result, "malloc_zero", "ParamInvalid", "positive")
        expect(result, "bad_shape", "ParamInvalid", "(2, -1)")
        expect(result, "bad_dtype", "ParamInvalid", "dtype")
        expect(result, "wait_timeout", "TransferTimeout", "'never'", "== 5", "still 0")
        expect(result, "asymmetric", "SymmetryError", "disagree")
        assert result["asymmetric"]["failed"] == [1 - result["pe"]]  # names the other PE
        assert result["still_works"] is True


@pytest.mark.parametrize(("n_pes", "local_paths"), [(3, True), (2, False)],
                         ids=["3pes-mapped", "2pes-tcp"])
def test_put_batch_and_get_batch_move_many_pairs_per_call_and_check_all_first(
        pes, n_pes: int, local_paths: bool) -> None:
    for result in [proc.result() for proc in pes("batch", n_pes, local_paths=local_paths)]:
        for key in ("put_bad", "put_nbi_bad", "get_bad", "get_nbi_bad"):
            assert result[key] == [], (result["pe"], key, result[key])
        assert result["registrations_added"] == 2 * n_pes  # 40 row views: one registration
        expect(result, "overflow", "OutOfRange", "put_batch pair 39", "4161 bytes", "4160 bytes",
               "nothing moved")
        expect(result, "not_symmetric", "ParamInvalid", "put_batch pair 39", "not symmetric")
        expect(result, "not_a_pair", "ParamInvalid", "put_batch pair 39", "(dst, src) pair")
        expect(result, "not_a_list", "ParamInvalid", "get_batch", "sequence of (dst, src)")
        expect(result, "readonly_dst", "ParamInvalid", "get_batch pair 3", "read-only")
        expect(result, "get_overrun", "OutOfRange", "get_batch pair 1", "8320 bytes")
        expect(result, "bad_pe", "ParamInvalid", f"pe {n_pes} is out of range")
        assert result["nothing_moved"] is True


@pytest.mark.parametrize(("n_pes", "local_paths"), [(3, True), (2, False)],
                         ids=["3pes-mapped", "2pes-tcp"])
def test_array_batches_move_offset_arrays_per_call_and_check_all_first(
        pes, n_pes: int, local_paths: bool) -> None:
    for result in [proc.result() for proc in pes("array_batch", n_pes, local_paths=local_paths)]:
        for key in ("put_bad", "put_nbi_bad", "get_bad"):
            assert result[key] == [], (result["pe"], key, result[key])
        assert result["edge_bad"] is False, result["pe"]
        expect(result, "unequal", "ParamInvalid", "put_batch", "differ in length",
               "40 dst_offsets, 39 src_offsets", "nothing moved")
        expect(result, "float", "ParamInvalid", "put_batch", "lengths must be an integer "
               "array", "float64")
        expect(result, "negative", "ParamInvalid", "put_batch: move 3", "+-1")
        expect(result, "dst_outside", "OutOfRange", "put_batch: move 25: dst range "
               "[166390, +4160) is not inside its 166400-byte dst")
        expect(result, "src_outside", "OutOfRange", "put_batch: move 7: src range "
               "[166400, +4160)")
        expect(result, "not_symmetric", "ParamInvalid", "put_batch", "not symmetric")
        assert result["nothing_moved"] is True


def test_a_killed_pe_makes_the_waiters_fail_with_peer_unavailable(pes) -> None:
    victim = 2
    procs = pes("wait_for_victim", 3, victim=victim, lease_ttl_ms=1000, wait_timeout=30)
    for proc in procs:
        assert proc.line() == {"event": "ready"}
    procs[victim].proc.send_signal(signals.SIGKILL)
    procs[victim].proc.wait(30)
    for proc in procs[:victim]:
        outcome = proc.result()
        assert outcome["error"] == "PeerUnavailable", outcome
        assert outcome["failed"] == [victim]
        assert f"PE {victim}" in outcome["message"] and "gone" in outcome["message"]
        # and a put to it afterwards fails at once, naming it
        assert outcome["put_after"]["error"] in {"PeerUnavailable", "TransferTimeout"}, outcome
        assert f"PE {victim}" in outcome["put_after"]["message"]


def test_init_names_missing_pes_and_disagreeing_ones(pes) -> None:
    # init's timeout: long enough for the PEs that do exist to start on a loaded machine
    missing = pes("init_only", 3, pes=[0, 1], timeout=4)
    # PE 1 of this job believes the job has 3 PEs
    job = f"mismatch-{uuid.uuid4().hex[:6]}"
    mismatched = pes("init_only", 2, pes=[0], timeout=4, job=job) + pes(
        "init_only", 3, pes=[1], timeout=4, job=job)
    for proc in missing:
        reply = proc.line()
        assert reply["error"] == "TransferTimeout", reply
        assert reply["failed"] == [2] and "PE(s) [2]" in reply["message"]
    replies = [proc.line() for proc in mismatched]
    for reply in replies:
        assert reply["error"] in {"ParamInvalid", "TransferTimeout"}, reply
    assert any("n_pes=3" in reply["message"] for reply in replies), replies


def test_parallel_jobs_on_one_master_do_not_mix(pes, master: MasterProcess) -> None:
    # neither passes init a job: one names it in the bootstrap, one in $HIXL_SHMEM_JOB
    first = pes("init_only", 2, job=None,
                bootstrap=f"{master.target}/alpha-{uuid.uuid4().hex[:6]}")
    second = pes("init_only", 2, job=None,
                 env={"HIXL_SHMEM_JOB": f"beta-{uuid.uuid4().hex[:6]}"})
    results_first = [proc.result() for proc in first]
    results_second = [proc.result() for proc in second]
    for group in (results_first, results_second):
        engines = [r["engine"] for r in group]
        assert all(r["peers"] == engines for r in group), group
        assert len({r["job"] for r in group}) == 1
    assert not set(results_first[0]["peers"]) & set(results_second[0]["peers"])
    assert results_first[0]["job"].startswith("alpha-")
    assert results_second[0]["job"].startswith("beta-")


def test_init_checks_its_arguments_before_starting_anything(master: MasterProcess) -> None:
    boot = master.target
    cases = [
        (dict(my_pe=2, n_pes=2, bootstrap=boot), "my_pe"),
        (dict(my_pe=-1, n_pes=2, bootstrap=boot), "my_pe"),
        (dict(my_pe=0, n_pes=0, bootstrap=boot), "n_pes"),
        (dict(my_pe=0, n_pes=1, bootstrap=boot, heap_size="lots"), "heap_size"),
        (dict(my_pe=0, n_pes=1, bootstrap=boot, heap_size=0), "heap_size"),
        (dict(my_pe=0, n_pes=1, bootstrap="127.0.0.1"), "port"),
        (dict(my_pe=0, n_pes=1, bootstrap=""), "bootstrap"),
        (dict(my_pe=0, n_pes=1, bootstrap=boot, timeout=0), "timeout"),
        (dict(my_pe=0, n_pes=1, bootstrap=boot, job="a/b"), "job"),
    ]
    for kwargs, word in cases:
        with pytest.raises(ParamInvalid) as caught:
            shmem.ShmemContext(**kwargs)
        assert word in str(caught.value), (kwargs, caught.value)


def test_a_single_pe_job_in_this_process_and_the_module_api_before_init(
        master: MasterProcess) -> None:
    with pytest.raises(NotConnected, match="init"):
        shmem.put(None, b"", 0)
    shmem.finalize()  # a no-op before init
    ctx = shmem.init(0, 1, master.target, "1MiB", job=f"solo-{uuid.uuid4().hex[:6]}",
                     timeout=20)
    try:
        assert (shmem.my_pe(), shmem.n_pes()) == (0, 1)
        with pytest.raises(ParamInvalid, match="already initialised"):
            shmem.init(0, 1, master.target)
        obj = shmem.create_tensor((2, 3), np.int32)
        data = np.arange(6, dtype=np.int32).reshape(2, 3)
        shmem.put(obj, data, 0)  # to itself: a local copy
        back, row = np.zeros_like(data), np.zeros(3, np.int32)
        shmem.get(back, obj, 0)
        shmem.get(row, obj[1], 0)
        assert np.array_equal(obj.local, data) and np.array_equal(back, data)
        assert np.array_equal(row, data[1])
        sig = shmem.create_signal()
        shmem.signal(sig, 5, 0, shmem.ADD)
        shmem.signal(sig, 2, 0, shmem.ADD)
        assert shmem.wait_until(sig, shmem.EQ, 7, timeout=5) == 7
        shmem.clear(sig)
        assert shmem.signal_fetch(sig) == 0
        shmem.barrier_all()
    finally:
        shmem.finalize()
    assert ctx.finalized
    ctx.finalize()  # idempotent


LAST_BARRIER_PES, LAST_BARRIER_ROUNDS = 6, 50


@pytest.mark.timeout(600)  # 50 jobs on a loaded machine: a guard against a hang only
def test_a_pe_leaving_right_after_the_last_barrier_never_fails_a_slower_one(pes) -> None:
    # PEs leave the moment they get through finalize's barrier, while slower ones (niced,
    # under GIL churn) may be between reading a leaver's epoch and its departure word,
    # or still waiting for their own epoch write to a leaver to be acknowledged. Before
    # the departure word said which barrier its PE got through, about half of the runs
    # failed with "PE(s) [k] finalized before barrier 2" or a barrier write "to PE k":
    # "deregistered by its owner during this transfer". A master of its own: its 300
    # engines come and go without crowding the module's (over 300 engines the OS hands
    # some agent port out twice: the master must take the new engine under that name).
    with MasterProcess() as own:
        procs = pes("last_barrier", LAST_BARRIER_PES, last=LAST_BARRIER_PES - 1,
                    rounds=LAST_BARRIER_ROUNDS, timeout=30, bootstrap=own.target)
        replies = [proc.line(give_up=500) for proc in procs]
    assert all("result" in reply for reply in replies), replies
    results = [reply["result"] for reply in replies]
    failures = {pe: r["failures"] for pe, r in enumerate(results) if r["failures"]}
    assert failures == {}, failures
    assert [r["rounds"] for r in results] == [LAST_BARRIER_ROUNDS] * LAST_BARRIER_PES


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_pe_that_finalizes_before_a_barrier_is_reported_to_the_waiters(pes, when: str) -> None:
    early = 1
    # the barrier's deadline is far beyond the test's give-up time: only the departure
    # word can end the wait, as PeerUnavailable naming the PE
    procs = pes("finalize_early", 3, early=early, when=when, barrier_timeout=10 * GIVE_UP_S)
    for pe, proc in enumerate(procs):
        outcome = proc.result()
        if pe == early:
            assert outcome == {"error": None}
            continue
        assert outcome["error"] == "PeerUnavailable", outcome
        assert outcome["failed"] == [early], outcome
        assert f"PE(s) [{early}] finalized before barrier 2" in outcome["message"], outcome
