"""hixl.segment_states: the slot words, and the agent's life word, which the kernel marks
when the owning process dies (a robust futex) and a clean close clears."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from hixl.segment_states import FUTEX_OWNER_DIED, SegmentStates, StateView, owner_alive

CHILD = """
import os, sys
from hixl.segment_states import SegmentStates
states = SegmentStates(capacity=64)
states.claim(7)
print(os.getpid(), states.fd, flush=True)
sys.stdin.readline()
os._exit(0)  # no close: only the kernel can tell peers this process is gone
"""


def view_of(pid: int, fd: int, capacity: int) -> StateView:
    handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY)
    try:
        return StateView(handle, capacity)
    finally:
        os.close(handle)


def life_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name == "hixl-life-word"}


def test_life_word_names_a_live_thread_until_close() -> None:
    before = life_threads()  # other tests' agents in this process hold theirs
    states = SegmentStates(capacity=64)
    view = view_of(os.getpid(), states.fd, 64)
    slot = states.claim(11)
    assert slot != 0 and view.holds(slot, 11)
    assert view.owner_alive()
    (ours,) = life_threads() - before
    states.close()
    assert not view.owner_alive() and not view.holds(slot, 11)
    assert not ours.is_alive()


def test_a_process_that_exits_without_closing_is_marked_dead_by_the_kernel() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pid, fd = map(int, child.stdout.readline().split())  # type: ignore[union-attr]
        view = view_of(pid, fd, 64)
        assert view.owner_alive() and view.holds(1, 7)
        child.stdin.write("exit\n")  # type: ignore[union-attr]
        child.stdin.flush()  # type: ignore[union-attr]
        assert child.wait(timeout=30) == 0
        assert not view.owner_alive()
        assert view.holds(1, 7)  # the slot words stay as they were: the life word says it
    finally:
        child.kill()
        child.wait()


def test_owner_alive_reads_the_futex_bits() -> None:
    assert owner_alive(1234)
    assert not owner_alive(0)                            # never owned, or closed
    assert not owner_alive(FUTEX_OWNER_DIED)             # what the kernel leaves
    assert not owner_alive(FUTEX_OWNER_DIED | 1234)
