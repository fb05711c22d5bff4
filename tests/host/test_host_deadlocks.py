"""Deadlocks across processes on one host: a cycle through threads of several processes ends
with DeadlockError in one of them (no timeout set), readers and writers included; a chain that
is no cycle, and a publication left by a process that died, never do. Both engines, both
kernel mechanisms, spawned processes."""

from __future__ import annotations

import os
import sys
import time
from types import ModuleType
from typing import Any

import pytest

from conftest import wait_until
from lockmgr._args import WRITE
from lockmgr.host import HostLockManager
from lockmgr.host import _waits
from lockmgr.host._waits import LOOK_EVERY

pytestmark = [pytest.mark.timeout(120), pytest.mark.posix_only]


def outcome(child: Any) -> str:
    """The answer of the command sent last: "True"/"False", or an error's name."""
    answer = child._next()
    return answer.get("error") or repr(answer["value"])


@pytest.fixture
def board(host_engine: ModuleType, lock_dir: str, mechanism: str) -> Any:
    """The directory's table of published waits, as this process reads it."""
    manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    yield manager._shared.waits
    manager.close()


def published_by(board: Any, child: Any) -> bool:
    return any(wait[1] == child.pid for wait in board.live().values())


def test_a_cycle_through_two_processes_ends_with_deadlock_error_in_one(
        children: Any, board: Any) -> None:
    first, second = children(), children()
    assert first.ask("locks.acquire('a')") is True
    assert second.ask("locks.acquire('b')") is True
    first.send("locks.acquire('b')")
    second.send("locks.acquire('a')")
    wait_until(lambda: first.answered() or second.answered(), "one of them gives up")
    loser, winner = (first, second) if first.answered() else (second, first)
    assert outcome(loser) == "DeadlockError"
    loser.ask("locks.release_all()")
    assert outcome(winner) == "True"


def test_a_cycle_through_three_processes_is_found(children: Any, board: Any) -> None:
    members = [children() for _ in range(3)]
    for member, key in zip(members, "abc"):
        assert member.ask(f"locks.acquire({key!r})") is True
    for member, key in zip(members, "bca"):
        member.send(f"locks.acquire({key!r})")
    wait_until(lambda: any(member.answered() for member in members), "one gives up")
    losers = [member for member in members if member.answered()]
    assert [outcome(loser) for loser in losers] == ["DeadlockError"] * len(losers)
    for loser in losers:
        loser.ask("locks.release_all()")
    waiting = [member for member in members if member not in losers]
    while waiting:  # each gets its key once the one it waits for lets go
        wait_until(lambda: any(member.answered() for member in waiting), "one gets its key")
        member = next(member for member in waiting if member.answered())
        assert outcome(member) == "True"
        member.ask("locks.release_all()")
        waiting.remove(member)


def test_a_cycle_through_a_waiting_writer_and_readers_is_found(
        children: Any, board: Any) -> None:
    # R reads x and waits to write y; V waits to write x (behind R); W writes y and waits to
    # read x, which a waiting writer keeps new readers out of: W waits for V, V for R, R for W.
    reader, writer, other = children(), children(), children()
    assert reader.ask("rw.acquire_read('x')") is True
    assert other.ask("rw.acquire_write('y')") is True
    writer.send("rw.acquire_write('x')")
    wait_until(lambda: published_by(board, writer), "the writer's wait is published")
    other.send("rw.acquire_read('x')")
    reader.send("rw.acquire_write('y')")
    members = [reader, writer, other]
    wait_until(lambda: any(member.answered() for member in members), "one gives up")
    losers = [member for member in members if member.answered()]
    assert {outcome(loser) for loser in losers} == {"DeadlockError"}


def test_a_chain_that_is_no_cycle_never_ends_with_deadlock_error(
        children: Any, board: Any) -> None:
    first, second, last = children(), children(), children()
    assert first.ask("locks.acquire('a')") is True
    assert second.ask("locks.acquire('b')") is True
    assert last.ask("locks.acquire('c')") is True
    first.send("locks.acquire('b')")
    second.send("locks.acquire('c')")
    wait_until(lambda: published_by(board, first) and published_by(board, second),
               "both waits are published")
    time.sleep(4 * LOOK_EVERY)  # several looks of each: none may find a cycle
    assert not first.answered() and not second.answered()
    last.ask("locks.release('c')")
    assert outcome(second) == "True"
    second.ask("locks.release_all()")
    assert outcome(first) == "True"


def test_a_wait_published_by_a_process_that_died_is_not_followed(
        children: Any, board: Any) -> None:
    # The second dead one held a and waited for b: followed, it would close b's holder's wait
    # for a (now held by a process that waits for nothing) into a cycle. The first dead one's
    # slot comes first: the new wait is published there, and the second's stays as it was.
    first_dead, dead, holder_of_b, holder_of_a = (children() for _ in range(4))
    assert holder_of_b.ask("locks.acquire_many(['b', 'r'])") is True
    assert first_dead.ask("locks.acquire('q')") is True
    first_dead.send("locks.acquire('r')")
    wait_until(lambda: published_by(board, first_dead), "the first wait is published")
    assert dead.ask("locks.acquire('a')") is True
    dead.send("locks.acquire('b')")
    wait_until(lambda: published_by(board, dead), "the second wait is published")
    first_dead.kill()
    dead.kill()
    assert holder_of_a.ask("locks.acquire('a', timeout=30)") is True
    holder_of_b.send("locks.acquire('a', timeout=6 * %r)" % LOOK_EVERY)
    assert outcome(holder_of_b) == "False"  # timed out: no DeadlockError


def interrupting_on_return(function: Any) -> Any:
    """A trace function that raises KeyboardInterrupt once, as ``function`` returns: where a
    signal handler raises if the signal lands after its last line."""
    fired: list[bool] = []

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not function.__code__:
            return None

        def at_return(frame: Any, event: str, arg: Any) -> Any:
            if event == "return" and not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return at_return
        return at_return
    return trace, fired


def test_an_interrupt_while_a_wait_is_published_leaves_no_publication(
        host_engine: ModuleType, lock_dir: str, mechanism: str, children: Any) -> None:
    # Left behind, the publication (this thread holds x, waits for y) would close a false
    # cycle for the other process, which holds y and waits for x.
    other = children()
    locks: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    try:
        assert other.ask("locks.acquire('y')") is True
        assert locks.acquire("x")
        trace, fired = interrupting_on_return(_waits.WaitBoard.publish)
        sys.settrace(trace)
        try:
            with pytest.raises(KeyboardInterrupt):
                locks.acquire("y", timeout=10)
        finally:
            sys.settrace(None)
        assert fired
        assert not any(wait[1] == os.getpid() for wait in locks._shared.waits.live().values())
        other.send(f"locks.acquire('x', timeout={8 * LOOK_EVERY})")
        assert outcome(other) == "False"  # timed out: no false DeadlockError
    finally:
        locks.release_all()
        locks.close()


def _interrupting_line(code: Any, at: int) -> Any:
    """A trace function raising KeyboardInterrupt at the ``at``-th line event of ``code``
    (as a signal handler would there); it then traces no more. ``at`` -1: only counts them,
    in ``lines``."""
    lines = [0]

    def trace(frame: Any, event: str, arg: object) -> Any:
        if frame.f_code is not code:
            return None
        if event == "line":
            lines[0] += 1
            if lines[0] == at:
                raise KeyboardInterrupt
        return trace

    trace.lines = lines  # type: ignore[attr-defined]
    return trace


def test_a_thread_interrupted_making_its_levels_stays_seen_by_the_deadlock_look(
        host_engine: ModuleType, lock_dir: str, mechanism: str) -> None:
    """An interrupt at any line of a thread's first call leaves every level it holds after
    in what the deadlock look reads (``_held_idents``: a cycle through it is found)."""
    code = HostLockManager._levels.__code__
    counting = _interrupting_line(code, -1)
    probe: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    sys.settrace(counting)
    try:
        probe._levels()
    finally:
        sys.settrace(None)
    probe.close()
    assert counting.lines[0] >= 3
    for at in range(1, counting.lines[0] + 1):
        manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
        sys.settrace(_interrupting_line(code, at))
        try:
            with pytest.raises(KeyboardInterrupt):
                manager._levels()
        finally:
            sys.settrace(None)
        assert manager.acquire("a") is True
        try:
            assert (manager.host_key("a"), WRITE) in manager._held_idents([]), at
        finally:
            manager.release("a")
            manager.close()
