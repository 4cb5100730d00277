"""hixl.shmem across simulated hosts (tests/netns.py): a hixl-master on one host, PEs on
several, so PEs on different hosts reach each other over TCP while PEs sharing a host
map each other's heaps. The same core scenario as on one node (tests/test_shmem.py),
every byte checked in the PEs.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from netns import Cluster
from test_shmem import PeProcess, check_core

pytestmark = pytest.mark.netns



@pytest.fixture(scope="module")
def cluster(netns) -> Iterator[tuple[Cluster, str]]:
    cluster = netns(3)
    master = cluster.start_master(cluster.hosts[0])
    yield cluster, master


def run_job(cluster: Cluster, master: str, scenario: str, hosts: list[int],
            **fields: object) -> list[PeProcess]:
    """PE k of a new job on cluster.hosts[hosts[k]]."""
    job = f"{scenario}-{uuid.uuid4().hex[:8]}"
    return [PeProcess({"scenario": scenario, "pe": pe, "n_pes": len(hosts), "bootstrap": master,
                       "job": job, **fields},
                      spawn=cluster.hosts[host].spawn, log_dir=cluster.run_dir)
            for pe, host in enumerate(hosts)]


def test_one_pe_per_host_moves_every_byte_over_tcp(cluster) -> None:
    cluster, master = cluster
    procs = run_job(cluster, master, "core", [0, 1, 2])
    try:
        check_core([proc.result() for proc in procs], lambda me, t: "tcp")
    finally:
        for proc in procs:
            proc.close()


def test_pes_sharing_a_host_map_each_other_and_reach_the_rest_over_tcp(cluster) -> None:
    cluster, master = cluster
    hosts = [0, 0, 1, 2]
    procs = run_job(cluster, master, "core", hosts)
    try:
        check_core([proc.result() for proc in procs],
                   lambda me, t: "fabric" if hosts[me] == hosts[t] else "tcp")
    finally:
        for proc in procs:
            proc.close()


def test_a_killed_pe_on_another_host_makes_the_waiters_fail(cluster) -> None:
    cluster, master = cluster
    victim = 2
    procs = run_job(cluster, master, "wait_for_victim", [0, 1, 2], victim=victim,
                    lease_ttl_ms=1000, wait_timeout=30)
    try:
        for proc in procs:
            assert proc.line() == {"event": "ready"}
        procs[victim].proc.kill()
        procs[victim].proc.wait(30)
        for proc in procs[:victim]:
            outcome = proc.result()
            assert outcome["error"] == "PeerUnavailable", outcome
            assert outcome["failed"] == [victim] and f"PE {victim}" in outcome["message"]
            assert outcome["put_after"]["error"] in {"PeerUnavailable", "TransferTimeout"}
            assert f"PE {victim}" in outcome["put_after"]["message"]
    finally:
        for proc in procs:
            proc.close()
