"""Several nodes: agents and engines on separate simulated hosts (tests/netns.py).

Each host has its own network namespace (a veth to a shared switch), hostname, /tmp,
/dev/shm, /run and PID namespace, so nothing but the network joins them. Every byte is
checked by digest, and the veth counters prove the bytes crossed the link. Deadlines in
here only guard against hangs; no assertion depends on timing.
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from netns import Cluster, Host

from hixl import wire

pytestmark = pytest.mark.netns

POOL = 32 << 20
PAYLOAD = 4 << 20  # per pair: far more than the control-plane chatter on a link


def pattern(seed: int, size: int) -> np.ndarray:
    """The bytes engine_worker.py writes for `seed` (same generator)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def digest_of(seed: int, size: int) -> str:
    return hashlib.sha256(pattern(seed, size).tobytes()).hexdigest()


def traffic(hosts: list[Host]) -> list[tuple[int, int]]:
    """(tx_bytes, rx_bytes) of every host's link."""
    return [(host.tx_bytes(), host.rx_bytes()) for host in hosts]


def grown(before: list[tuple[int, int]], after: list[tuple[int, int]], i: int) -> tuple[int, int]:
    """How many bytes host i sent and received on its link between two `traffic` calls."""
    return after[i][0] - before[i][0], after[i][1] - before[i][1]


def kv_of(reply: dict[str, Any]) -> dict[str, Any]:
    (segment,) = [s for s in reply["segments"] if s["name"] == "kv"]
    return segment


@pytest.fixture(scope="module")
def cluster(netns) -> Iterator[Cluster]:
    """Three hosts, each running a hixl-agent with a 32 MiB "kv" pool segment."""
    cluster = netns(3)
    for host in cluster.hosts:
        cluster.start_agent(host, {"pool": [{"name": "kv", "size": POOL, "perms": "rw"}]})
    yield cluster


@pytest.mark.parametrize("fabric", ["1", "0"], ids=["fabric-on", "fabric-off"])
def test_put_get_between_every_pair_of_hosts_crosses_the_link(cluster: Cluster,
                                                               fabric: str) -> None:
    """A writes into a segment it allocated on B and reads it back; C reads it too.

    Across hosts the fabric option must not map anything: every op takes TCP, and the
    payload shows up in the link counters of both ends.
    """
    hosts, agents = cluster.hosts, cluster.agents
    n = len(hosts)
    written: dict[tuple[int, int], tuple[list[list[int]], str]] = {}
    for a, host in enumerate(hosts):
        with cluster.worker(host, fabric) as worker:
            before = traffic(hosts)
            for b in range(n):
                if b == a:
                    continue
                target = agents[b].engine
                worker.ok("connect", agent=target)
                segment = worker.ok("allocate", agent=target, size=PAYLOAD,
                                    name=f"from-{host.name}-{fabric}")["segment"]
                assert segment["node_id"].startswith(hosts[b].name + ":")
                assert worker.ok("route", agent=target, addr=segment["base"])["route"] == "tcp"
                ranges = [[segment["base"], PAYLOAD]]
                seed = 1000 * int(fabric) + 10 * a + b
                put = worker.ok("write", agent=target, ranges=ranges, seed=seed)["sha256"]
                assert put == digest_of(seed, PAYLOAD)
                assert worker.ok("read", agent=target, ranges=ranges)["sha256"] == put
                written[(a, b)] = (ranges, put)
            after = traffic(hosts)
        sent, received = grown(before, after, a)
        assert sent >= (n - 1) * PAYLOAD and received >= (n - 1) * PAYLOAD, (sent, received)
        for b in range(n):
            if b != a:
                b_sent, b_received = grown(before, after, b)
                assert b_received >= PAYLOAD and b_sent >= PAYLOAD, (hosts[b], b_sent, b_received)

    # every segment read again from the third host, whose link carries it in
    for c, host in enumerate(hosts):
        pairs = [(a, b) for (a, b) in written if c not in (a, b)]
        with cluster.worker(host, fabric) as worker:
            for b in sorted({b for _, b in pairs}):
                worker.ok("connect", agent=agents[b].engine)
            before = traffic(hosts)
            for a, b in pairs:
                ranges, put = written[(a, b)]
                assert worker.ok("route", agent=agents[b].engine, addr=ranges[0][0])["route"] == "tcp"
                got = worker.ok("read", agent=agents[b].engine, ranges=ranges)["sha256"]
                assert got == put, f"{hosts[c]} read from {hosts[b]} what {hosts[a]} wrote"
            after = traffic(hosts)
        assert grown(before, after, c)[1] >= len(pairs) * PAYLOAD
        for _, b in pairs:
            assert grown(before, after, b)[0] >= PAYLOAD


def test_a_client_on_the_agents_own_host_maps_or_uses_the_unix_socket(cluster: Cluster) -> None:
    """Processes on one host share its /run and /dev/shm: same-node paths, no link traffic."""
    hosts, agent = cluster.hosts, cluster.agents[0]
    for fabric, path in (("1", "fabric"), ("0", "unix")):
        with cluster.worker(hosts[0], fabric) as worker:
            kv = kv_of(worker.ok("connect", agent=agent.engine))
            ranges = [[kv["base"], PAYLOAD]]
            assert worker.ok("route", agent=agent.engine, addr=kv["base"])["route"] == path
            before = traffic(hosts)
            put = worker.ok("write", agent=agent.engine, ranges=ranges, seed=40 + int(fabric))
            assert worker.ok("read", agent=agent.engine, ranges=ranges) == put
            after = traffic(hosts)
        sent, received = grown(before, after, 0)
        assert sent < PAYLOAD and received < PAYLOAD, (path, sent, received)


def test_frames_naming_another_nodes_segment_or_garbage_are_refused(cluster: Cluster) -> None:
    """Raw frames from A at B's data port: C's segment handle is refused, garbage is shrugged off."""
    hosts, agents = cluster.hosts, cluster.agents
    a, b, c = hosts
    with cluster.worker(a, "0") as worker:
        own = kv_of(worker.ok("connect", agent=agents[b.index - 1].engine))
        foreign = kv_of(worker.ok("connect", agent=agents[c.index - 1].engine))
        target = agents[b.index - 1].engine
        whole = [[own["base"], own["length"]]]
        before = worker.ok("read", agent=target, ranges=whole)["sha256"]
        address = "{}:{}".format(*agents[b.index - 1].data_tcp)

        payload = bytes(pattern(7, 4096))
        frames = (wire.hello(1, b"pytest-raw")
                  # C's handle exactly as C published it
                  + wire.write_header(2, foreign["segment_id"], foreign["epoch"],
                                      foreign["base"], 4096) + payload
                  # C's segment id and address with B's epoch
                  + wire.write_header(3, foreign["segment_id"], own["epoch"],
                                      foreign["base"], 4096) + payload
                  + wire.read_request(4, foreign["segment_id"], foreign["epoch"],
                                      foreign["base"], 64)
                  # and a valid read on the same connection: it survived the refusals
                  + wire.read_request(5, own["segment_id"], own["epoch"], own["base"], 64))
        answer = worker.ok("raw", address=address, send=frames.hex(), replies=5, timeout=10)
        replies = {r["request_id"]: r for r in answer["replies"]}
        assert sorted(replies) == [1, 2, 3, 4, 5], answer
        refusals = {wire.Reason.UNKNOWN_SEGMENT, wire.Reason.STALE_EPOCH, wire.Reason.OUT_OF_RANGE}
        for rid in (2, 3, 4):
            assert replies[rid]["status"] != 0 and replies[rid]["reason"] in refusals, replies[rid]
        assert replies[5]["status"] == 0 and len(bytes.fromhex(replies[5]["payload"])) == 64

        # garbage that is no header at all, then a header of an unknown protocol version
        junk = b"GET / HTTP/1.1\r\nHost: hixl\r\n\r\n" + bytes(pattern(8, 8192))
        for blob in (junk, b"\x48\x58\x09" + bytes(45) + junk):
            answer = worker.ok("raw", address=address, send=blob.hex(), replies=2, timeout=10)
            assert answer["closed"], answer
            for reply in answer["replies"]:
                assert reply["status"] != 0, reply

        # B still serves everyone, and not a byte of its segment changed
        assert worker.ok("read", agent=target, ranges=whole)["sha256"] == before
        hello = worker.ok("raw", address=address, send=wire.hello(9).hex(), replies=1)
        assert hello["replies"][0]["status"] == 0 and hello["replies"][0]["epoch"] == own["epoch"]
    with cluster.worker(c, "1") as other:
        other.ok("connect", agent=target)
        put = other.ok("write", agent=target, ranges=[[own["base"], 65536]], seed=9)["sha256"]
        assert other.ok("read", agent=target, ranges=[[own["base"], 65536]])["sha256"] == put


def test_cut_link_fails_by_the_deadline_and_the_same_engine_recovers(cluster: Cluster) -> None:
    a, b = cluster.hosts[0], cluster.hosts[1]
    target = cluster.agents[1].engine
    with cluster.worker(a, "1") as worker:
        kv = kv_of(worker.ok("connect", agent=target))
        ranges = [[kv["base"] + 4096, 1 << 20]]
        assert worker.ok("write", agent=target, ranges=ranges, seed=21)["sha256"] == digest_of(
            21, 1 << 20)
        b.link_down()
        try:
            failed = worker.call("write", agent=target, ranges=ranges, seed=22, timeout=2)
            refused = worker.call("read", agent=target, ranges=ranges, timeout=2)
        finally:
            b.link_up()
        for answer in (failed, refused):
            assert answer.get("error") in ("TransferTimeout", "PeerUnavailable"), answer
            assert answer["failed"] == [0], answer
        # same process, same engine, no reconnect: it works again
        put = worker.ok("write", agent=target, ranges=ranges, seed=23, timeout=20)["sha256"]
        assert worker.ok("read", agent=target, ranges=ranges, timeout=20)["sha256"] == put
        assert put == digest_of(23, 1 << 20)


def test_agent_killed_mid_transfer_fails_it_and_a_restart_serves_a_new_epoch(
        cluster: Cluster) -> None:
    a = cluster.hosts[0]
    agent = cluster.agents[1]
    with cluster.worker(a, "1") as worker:
        kv = kv_of(worker.ok("connect", agent=agent.engine))
        old_epoch = agent.epoch
        assert kv["epoch"] == old_epoch
        # Freeze the agent so that the 1 GiB batch is surely in flight, then kill it.
        assert agent.proc is not None
        agent.proc.send_signal(signal.SIGSTOP)
        try:
            started = worker.ok("write_async", agent=agent.engine, ranges=[[kv["base"], 16 << 20]],
                                repeat=64, seed=31, timeout=10)
            assert started["status"] == "WAITING"
        finally:
            agent.kill()
        ended = worker.call("wait")
        assert ended.get("error") in ("PeerUnavailable", "TransferTimeout"), ended
        assert ended["request"] == "FAILED" and ended["failed"], ended

        agent.restart()
        assert agent.epoch > old_epoch
        worker.ok("disconnect", agent=agent.engine)
        fresh = kv_of(worker.ok("connect", agent=agent.engine))
        assert fresh["epoch"] == agent.epoch
        ranges = [[fresh["base"], 1 << 20]]
        put = worker.ok("write", agent=agent.engine, ranges=ranges, seed=32)["sha256"]
        assert worker.ok("read", agent=agent.engine, ranges=ranges)["sha256"] == put
