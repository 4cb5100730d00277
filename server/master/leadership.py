"""Which hixl-master of a cluster serves: the leader; the others stand by (issue 8).

Several `hixl-master` processes on one etcd prefix (`--etcd-endpoints`) campaign in one
etcd election (`hixl.etcd.Election`, name `master`, value: the master's advertised gRPC
"host:port"). The leader loads the store's committed state from etcd and serves; the
others are *standbys*: they serve their gRPC port and store call endpoint, but answer
every Master and Registry call (the registry watch included) "not the leader", naming
the leader, so clients go there by themselves (`hixl.failover`).

`Leadership` is the one switch every front end consults: `LeaderGate`, a gRPC server
interceptor, for the Master and Registry services, and the store call endpoint
(server/master/store_rpc_server.py) for its CALLs. `Candidate` campaigns, keeps the leader hint
current (an election observer), and calls `on_elected` once this master leads. Losing
the leadership afterwards (the election lease lost, another candidate leading, the
store's backend fenced) is final: `Leadership.depose` closes the gate at once and
`on_deposed` ends the process (hixl-master exits; its supervisor restarts it as a
standby). A single master without etcd has none of this.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from hixl.errors import HixlError
from hixl.etcd import UNAVAILABLE_ERRORS, Election, EtcdClient, EtcdConfig, Leader
from hixl.failover import NOT_LEADER_CODE, not_leader_metadata

log = logging.getLogger("hixl.master")

#: the election's name under the cluster's prefix: `<prefix>election/master/<lease id>`
ELECTION_NAME = "master"
#: how often a standby re-checks the election while waiting (a watch wakes it sooner)
POLL_S = 1.0
#: pause after etcd could not be reached while campaigning (doubling to the max)
RETRY_PAUSE_S = (0.2, 2.0)

STANDBY, LEADER, DEPOSED = "standby", "leader", "deposed"


class Leadership:
    """Whether this master serves now and, if not, which master does (thread-safe).

    `address`: this master's advertised gRPC "host:port". States: standby (the start),
    leader (`lead`), deposed (`depose`, final). While not leading, `refusal()` gives the
    hint to send callers to: the observed leader's address, or "" when unknown or when it
    is this master itself (elected, still loading, or deposed).
    """

    def __init__(self, address: str = "") -> None:
        self.address = address
        self._lock = threading.Lock()
        self._state = STANDBY
        self._leader = ""
        self._why = ""

    @property
    def state(self) -> str:
        return self._state

    @property
    def leading(self) -> bool:
        return self._state == LEADER

    @property
    def leader(self) -> str:
        """The leader's address as last observed ("" when there is none)."""
        return self._leader

    def observed(self, leader: str) -> None:
        """The election now names `leader` ("" for no candidate at all)."""
        with self._lock:
            self._leader = leader

    def lead(self) -> None:
        with self._lock:
            if self._state == STANDBY:
                self._state = LEADER

    def depose(self, why: str) -> bool:
        """Stop serving for good; True if this call deposed it (it was not already)."""
        with self._lock:
            if self._state == DEPOSED:
                return False
            self._state, self._why = DEPOSED, why
            return True

    def refusal(self) -> str | None:
        """None while leading; else the leader hint for a "not the leader" answer."""
        if self._state == LEADER:
            return None
        leader = self._leader
        return "" if leader == self.address else leader

    def describe(self) -> str:
        """This master's role in words, for the "not the leader" answers and logs."""
        me = f"hixl-master {self.address}"
        if self._state == LEADER:
            return f"{me} is the leader"
        if self._state == DEPOSED:
            return f"{me} is no longer the leader ({self._why}) and is shutting down"
        leader = self._leader
        if leader == self.address:
            return f"{me} was elected leader and is loading the store: try again shortly"
        return f"{me} is a standby; the leader is {leader or 'not known yet (an election is under way)'}"


class LeaderGate(grpc.aio.ServerInterceptor):
    """gRPC side of the gate: while its master does not lead, every call is answered
    NOT_LEADER_CODE with trailing metadata `hixl-leader: <leader>` (hixl.failover), before
    the method's handler runs: nothing is deserialized or executed."""

    def __init__(self, leadership: Leadership) -> None:
        self.leadership = leadership

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails],
                                         Awaitable[grpc.RpcMethodHandler | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        hint = self.leadership.refusal()
        if hint is None:
            return handler
        message = self.leadership.describe()

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            context.set_trailing_metadata(not_leader_metadata(hint))
            await context.abort(NOT_LEADER_CODE, message)

        if handler is not None and handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class Candidate:
    """This master's candidacy in the etcd election (see the module docstring).

    `enter()` (blocking) connects, stands as a candidate and starts observing the leader;
    it raises the client's typed error when etcd cannot be reached. `start()` then waits
    for the leadership on a thread and calls `on_elected(election, client)` there (it
    takes over the store; an exception it raises deposes this master). Afterwards, the
    election lease lost, another leader observed, or `fenced()` returning a reason
    deposes it: `on_deposed(reason)` is called once. `close()` resigns (a standby leads
    at once) and closes the client.
    """

    def __init__(self, etcd: EtcdConfig, leadership: Leadership, *, ttl: int,
                 on_elected: Callable[[Election, EtcdClient], None],
                 on_deposed: Callable[[str], None],
                 fenced: Callable[[], str] = lambda: "") -> None:
        self.etcd = etcd
        self.leadership = leadership
        self.ttl = ttl
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._fenced = fenced
        self._stop = threading.Event()
        self._recampaign = threading.Event()
        self._elected = False
        self._closing = False  # shutting down: a leadership ending now is no deposal
        self._thread: threading.Thread | None = None
        self.client: EtcdClient | None = None
        self.election: Election | None = None
        self._observer: Any = None

    def enter(self) -> None:
        client = EtcdClient(self.etcd, name="hixl-master-etcd")
        try:
            election = client.election(ELECTION_NAME, ttl=self.ttl, on_lost=self._lease_lost)
            self.client, self.election = client, election
            election.campaign(self.leadership.address, timeout=0.0)
            self._observer = election.observe(self._observed)
        except BaseException:
            self.client = self.election = None
            client.close()
            raise

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="hixl-master-candidate")
        self._thread.start()

    def halt(self) -> None:
        """Stop campaigning (a takeover under way finishes first); still a candidate."""
        self._closing = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(2 * self.etcd.timeout + POLL_S + 1.0)

    def close(self) -> None:
        """Resign (a standby takes over at once) and close the etcd client. Idempotent."""
        self.halt()
        if self._observer is not None:
            with contextlib.suppress(HixlError):
                self._observer.cancel()
            self._observer = None
        if self.election is not None:
            with contextlib.suppress(HixlError):
                self.election.resign()
            self.election = None
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- the campaign thread --------------------------------------------------------

    def _run(self) -> None:
        election = self.election
        assert election is not None and self.client is not None
        pause, said = RETRY_PAUSE_S[0], False
        while not self._stop.is_set():
            try:
                if self._recampaign.is_set():
                    self._recampaign.clear()
                    won = election.campaign(self.leadership.address, timeout=POLL_S)
                else:
                    started = time.monotonic()
                    won = election.wait(POLL_S)
                    if not won and time.monotonic() - started < POLL_S / 2:
                        self._recampaign.set()  # the candidacy is gone: stand again
                pause, said = RETRY_PAUSE_S[0], False
            except (UNAVAILABLE_ERRORS + (HixlError,)) as exc:
                if not said:
                    log.warning("election: etcd at %s cannot be reached (%s); this master "
                                "stays a standby and keeps trying", self.etcd.describe(), exc)
                    said = True
                self._recampaign.set()
                self._stop.wait(pause)
                pause = min(pause * 2, RETRY_PAUSE_S[1])
                continue
            if won and not self._stop.is_set():
                self._take_over(election)
                return

    def _take_over(self, election: Election) -> None:
        log.info("election: %s won the leadership of %s; taking over the store",
                 self.leadership.address, self.etcd.prefix)
        started = time.monotonic()
        self._elected = True
        try:
            assert self.client is not None
            self._on_elected(election, self.client)
        except Exception as exc:  # noqa: BLE001 - a master that cannot take over must not lead
            log.exception("election: taking over failed")
            self._depose(f"taking over failed: {exc}")
            return
        self.leadership.lead()
        log.info("leading: %s serves the store and the registry of %s (took over in %.3f s)",
                 self.leadership.address, self.etcd.prefix, time.monotonic() - started)
        # the backend fences itself on a failed compare; that ends the leadership too
        while not self._stop.wait(0.2):
            why = self._fenced()
            if why:
                self._depose(f"the store's metadata backend is fenced: {why}")
                return

    # -- callbacks (the etcd client's callback thread) ------------------------------

    def _observed(self, leader: Leader | None) -> None:
        address = leader.value.decode("utf-8", "replace") if leader is not None else ""
        self.leadership.observed(address)
        election = self.election
        if (self.leadership.leading and election is not None
                and (leader is None or leader.key != election.key)):
            self._depose(f"the election names {address or 'no leader'} now")
        elif not self.leadership.leading:
            log.info("election: the leader is %s", address or "not known (no candidate)")

    def _lease_lost(self, election: Election) -> None:
        if not self._elected:
            log.warning("election: this standby's candidacy lease was lost; standing again")
            self._recampaign.set()
            return
        self._depose(f"the election lease ({self.ttl} s) was lost: etcd did not confirm a "
                     "keepalive for a whole TTL")

    def _depose(self, why: str) -> None:
        if self._closing:
            return
        if self.leadership.depose(why):
            self._stop.set()
            log.error("%s", self.leadership.describe())
            self._on_deposed(why)
