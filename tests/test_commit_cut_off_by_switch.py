"""A put whose Commit or PutStart a leader kill cuts off is put again through the new
leader (issue 20 item 11), on real processes: three hixl-masters on a 3-member etcd, a
segment holder, one store client. The leader is stopped (SIGSTOP) so that it takes the
call but never answers, then killed: the call's connection breaks, and the client,
configured with every master, puts the value anew (two-phase) through the next leader
instead of returning RPC_FAIL. A small value takes the one-round-trip path (Commit); one
larger than a quarter of a reservation the two-phase path (PutStart).

Nothing here measures time: deadlines only bound waits.
"""

from __future__ import annotations

import signal
import threading
from functools import partial

import pytest
import waiting
from etcd_cluster import EtcdCluster
from test_master_failover import _all_stopped
from test_master_ha import (
    Masters,
    no_token_from_the_host,  # noqa: F401 - autouse fixture, used here too
)
from test_master_switch_holds_puts import GatedHolder, pattern
from test_soak import in_function

from hixl.client.mooncake import MooncakeDistributedStore

MiB = 1 << 20
WAIT_S = 60.0
wait_until = partial(waiting.wait_until, timeout=WAIT_S)


@pytest.mark.parametrize(("call", "size"), [("batch_commit", 40_000),
                                             ("batch_put_start", 9 * MiB)])
def test_a_put_cut_off_by_a_leader_kill_is_put_again_through_the_new_leader(
        cluster: EtcdCluster, call: str, size: int) -> None:
    with Masters(cluster, 3) as masters:
        leader = masters.leader()
        targets = ",".join(masters.targets)
        holder = GatedHolder(targets, 64 * MiB)
        holder.let_remount()  # remounts after the switch at once
        store = MooncakeDistributedStore(setup_timeout=WAIT_S)
        try:
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                               targets) == 0, store.last_error
            first, cut = pattern(1, 30_000), pattern(2, size)
            assert store.put("first", first) == 0
            space = store._space
            assert space is not None and space.commits == 1  # the one-round-trip path
            leader.proc.send_signal(signal.SIGSTOP)  # takes the Commit, never answers
            wait_until(lambda: _all_stopped(leader.proc.pid), "the leader to stop")
            result: list[int] = []
            putter = threading.Thread(target=lambda: result.append(store.put("cut", cut)))
            putter.start()
            wait_until(lambda: in_function(putter, call) or not putter.is_alive(),
                       f"the put's {call} sent to the stopped leader")
            assert putter.is_alive(), result
            leader.kill()  # its connections close: the call is cut off
            putter.join(WAIT_S)
            assert not putter.is_alive(), "the put hung"
            assert result == [0], store.last_error
            assert space.commits == 1  # a cut-off Commit did not count: put anew
            assert store.get("cut") == cut
            assert store.get("first") == first
        finally:
            store.close()
            holder.stop()
