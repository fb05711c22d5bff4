"""Deadlock cycles through both layers: a thread waits in process for another owner of this
process, whose chain waits on the server for another process, which waits for a lock the
first thread holds. The waiting thread finds the cycle and raises DeadlockError, holding
nothing of its call, within the server's ``deadlock_timeout`` plus a second, whichever wait
closed the cycle; a chain through the server that does not come back is no deadlock.

"Another process" is a server session of no manager of this process's (a connection of the
test's own): to the managers it is just that."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conftest import PATIENCE, Call, Worker, wait_until
import pgserver  # noqa: F401  (first: it skips this module where psycopg cannot load libpq)
from lockmgr import DeadlockError, postgres
from lockmgr.postgres import _deadlock
from lockmgr.postgres._deadlock import (
    LOOK_EVERY,
    PUBLISHABLE_PIDS,
    PUBLISHED,
    STAMPED,
    Lookout,
    connections_of,
)
from lockmgr.postgres._engine import _PgEngine
from pg_support import child, expect, finish, run, until

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")

#: What the issue allows past the server's deadlock_timeout, and the tests' slack for a
#: loaded machine on top.
WITHIN = 1.0
SLACK = 2.0


class OtherProcess:
    """A server session outside the managers: it takes keys of ``manager``'s namespace on a
    connection of its own, waiting in a thread of its own when they are held."""

    def __init__(self, dsn: str, manager: postgres.PgLockManager[Any]) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.pid = self.conn.info.backend_pid
        self.manager = manager
        self.waits: list[threading.Thread] = []

    def hold(self, key: str) -> None:
        self.conn.execute("SELECT pg_advisory_lock(%s)", (self.manager.advisory_key(key),))

    def wait_for(self, key: str) -> None:
        """Start waiting on the server for ``key`` (returns once the server shows the wait)."""
        thread = threading.Thread(target=self.hold, args=(key,), daemon=True)
        thread.start()
        self.waits.append(thread)
        wait_until(lambda: waiting_on_server(self.dsn, self.pid), "the other process waits")

    def let_go(self) -> None:
        """Once its waits are granted, give back everything it holds."""
        for thread in self.waits:
            thread.join(PATIENCE)
        assert not any(thread.is_alive() for thread in self.waits), "its wait never ended"
        self.waits.clear()
        self.conn.execute("SELECT pg_advisory_unlock_all()")


def waiting_on_server(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = %s AND NOT granted)",
                           (pid,)).fetchone()
    return bool(row and row[0])


def holders_backend(manager: postgres.PgLockManager[Any], key: str) -> int:
    """The backend pid of the connection of the owner holding ``key`` in process."""
    owners = {holder.owner for state in manager.snapshot() if state.key == key
              for holder in state.holders}
    backends = [pid for owner, pid, _ in connections_of(manager) if owner in owners]
    assert len(backends) == 1, (owners, backends)
    return backends[0]


def waits_in_process(manager: postgres.PgLockManager[Any], key: str) -> bool:
    return any(state.key == key and state.waiters for state in manager.snapshot())


@pytest.fixture
def deadlock_timeout(dsn: str) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT setting::float / 1000 FROM pg_settings"
                           " WHERE name = 'deadlock_timeout'").fetchone()
    assert row is not None
    return float(row[0])


@pytest.fixture
def other(dsn: str, pg_locks: postgres.PgLockManager[Any]) -> Iterator[OtherProcess]:
    process = OtherProcess(dsn, pg_locks)
    yield process
    process.let_go()
    process.conn.close()


def c_waits_on_the_server(pg_locks: postgres.PgLockManager[Any], other: OtherProcess,
                          c: Worker, hold_a: bool = True) -> Call:
    """The server side of the cycle: the other process holds "b" and waits for "a" (unless
    not ``hold_a``); C, holding "c", waits on the server for "b"."""
    other.hold("b")
    if hold_a:
        other.wait_for("a")
    c_waits = c.submit(lambda: pg_locks.acquire("b"))
    c_backend = holders_backend(pg_locks, "c")
    wait_until(lambda: waiting_on_server(other.dsn, c_backend), "C waits on the server")
    return c_waits


def break_the_cycle(pg_locks: postgres.PgLockManager[Any], other: OtherProcess, a: Worker,
                    c: Worker, c_waits: Call) -> None:
    """A, refused, lets go of "a": the other process gets it and lets go of "b", C gets it."""
    a.run(pg_locks.release_all)
    other.let_go()
    assert c_waits.result() is True
    c.run(pg_locks.release_all)


def test_a_thread_whose_wait_in_process_closes_the_cycle_gets_deadlock_error(
        pg_locks, other, deadlock_timeout, workers) -> None:  # type: ignore[no-untyped-def]
    """A holds "a"; C holds "c" and waits on the server for "b", which the other process
    holds while it waits for "a". A then waits in process for "c": the cycle closes."""
    a, c = workers("A"), workers("C")
    a.run(lambda: pg_locks.acquire("a"))
    c.run(lambda: pg_locks.acquire("c"))
    c_waits = c_waits_on_the_server(pg_locks, other, c)
    started = time.monotonic()
    with pytest.raises(DeadlockError, match="through PostgreSQL") as raised:
        a.run(lambda: pg_locks.acquire("c"))
    assert time.monotonic() - started < deadlock_timeout + WITHIN + SLACK
    assert raised.value.cycle == [(a.thread.ident, "c")]
    assert not waits_in_process(pg_locks, "c")  # nothing of the refused call is queued
    break_the_cycle(pg_locks, other, a, c, c_waits)


def test_a_thread_waiting_in_process_when_a_server_wait_closes_the_cycle_gets_deadlock_error(
        pg_locks, other, deadlock_timeout, workers) -> None:  # type: ignore[no-untyped-def]
    """The same cycle, closed last by C's wait on the server: A, which has waited in
    process all along, finds it at its next look."""
    a, c = workers("A"), workers("C")
    a.run(lambda: pg_locks.acquire("a"))
    c.run(lambda: pg_locks.acquire("c"))
    a_waits = a.submit(lambda: pg_locks.acquire("c"))
    wait_until(lambda: waits_in_process(pg_locks, "c"), "A waits in process")
    c_waits = c_waits_on_the_server(pg_locks, other, c)
    started = time.monotonic()
    with pytest.raises(DeadlockError, match="through PostgreSQL"):
        a_waits.result()
    assert time.monotonic() - started < deadlock_timeout + WITHIN + SLACK
    assert not waits_in_process(pg_locks, "c")
    break_the_cycle(pg_locks, other, a, c, c_waits)


def test_a_cycle_through_a_task_waiting_on_the_server_is_found_by_the_thread_waiting_for_it(
        pg_locks, other, deadlock_timeout, workers) -> None:  # type: ignore[no-untyped-def]
    """C is a task, on a loop in another thread: the thread waiting in process for the
    task's key finds the cycle through the task's connection."""
    a = workers("A")
    a.run(lambda: pg_locks.acquire("a"))
    other.hold("b")
    other.wait_for("a")
    task_holds = threading.Event()
    outcome: list[object] = []

    async def task() -> None:
        await pg_locks.aio.acquire("c")
        task_holds.set()
        outcome.append(await pg_locks.aio.acquire("b"))
        await pg_locks.aio.release("b")
        await pg_locks.aio.release("c")

    loop = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(task(), PATIENCE * 3)))
    loop.start()
    try:
        assert task_holds.wait(PATIENCE)
        task_backend = holders_backend(pg_locks, "c")
        wait_until(lambda: waiting_on_server(other.dsn, task_backend), "the task waits on the server")
        started = time.monotonic()
        with pytest.raises(DeadlockError, match="through PostgreSQL"):
            a.run(lambda: pg_locks.acquire("c"))
        assert time.monotonic() - started < deadlock_timeout + WITHIN + SLACK
        a.run(pg_locks.release_all)
        other.let_go()
    finally:
        loop.join(PATIENCE * 3)
    assert outcome == [True]


def test_a_chain_through_the_server_that_does_not_come_back_is_waited_out(
        pg_locks, other, workers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A waits in process for C, which waits on the server for the other process, which
    waits for nothing of A's: A looks, again and again, finds no cycle, and gets "c" once
    the chain moves on."""
    looked = counting_looks(monkeypatch)
    a, c = workers("A"), workers("C")
    a.run(lambda: pg_locks.acquire("a"))
    c.run(lambda: pg_locks.acquire("c"))
    other.hold("b")
    c_waits = c.submit(lambda: pg_locks.acquire("b"))
    c_backend = holders_backend(pg_locks, "c")
    wait_until(lambda: waiting_on_server(other.dsn, c_backend), "C waits on the server")
    a_waits = a.submit(lambda: pg_locks.acquire("c"))
    for _ in range(2):  # two looks that asked the server and found no cycle
        assert looked.acquire(timeout=PATIENCE)
    assert not a_waits.done()
    other.let_go()  # C gets "b", and gives everything back
    assert c_waits.result() is True
    c.run(pg_locks.release_all)
    assert a_waits.result() is True
    a.run(pg_locks.release_all)


def test_a_task_whose_wait_in_process_closes_the_cycle_gets_deadlock_error(
        pg_locks, other, deadlock_timeout, workers) -> None:  # type: ignore[no-untyped-def]
    """The waiter in process is a task: it looks too, while it waits, in a thread of the
    manager's (its loop's default executor is shut down here: the look does not need it)."""
    c = workers("C")
    c.run(lambda: pg_locks.acquire("c"))
    other.hold("b")

    async def main() -> Any:
        shut_down = concurrent.futures.ThreadPoolExecutor(1)
        shut_down.shutdown()
        asyncio.get_running_loop().set_default_executor(shut_down)
        await pg_locks.aio.acquire("a")
        other.wait_for("a")  # (blocking the loop: nothing else is to run on it meanwhile)
        c_waits = c.submit(lambda: pg_locks.acquire("b"))
        c_backend = holders_backend(pg_locks, "c")
        wait_until(lambda: waiting_on_server(other.dsn, c_backend), "C waits on the server")
        started = time.monotonic()
        with pytest.raises(DeadlockError, match="through PostgreSQL") as raised:
            await pg_locks.aio.acquire("c")
        assert time.monotonic() - started < deadlock_timeout + WITHIN + SLACK
        assert raised.value.cycle == [(asyncio.current_task(), "c")]
        assert not waits_in_process(pg_locks, "c")
        await pg_locks.aio.release("a")
        return c_waits

    c_waits = asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))
    other.let_go()
    assert c_waits.result() is True
    c.run(pg_locks.release_all)


CYCLE_CHILD = """
results = {}
e_holds, e_go = threading.Event(), threading.Event()

def thread_e():
    locks.acquire("e")
    e_holds.set()
    e_go.wait()
    results["e"] = locks.acquire("a", timeout=60)  # waits on the server for the parent's A
    locks.release_all()

e = threading.Thread(target=thread_e)
e.start()
e_holds.wait()
locks.acquire("d")
say(held=True)
sys.stdin.readline()
e_go.set()
try:
    results["d"] = locks.acquire("e", timeout=60)  # waits in process for E
except DeadlockError:
    results["d"] = "deadlock"
locks.release_all()
e.join()
say(**results)
"""


def test_a_cycle_through_the_waits_in_process_of_two_processes_is_found(
        engine, pg_locks, dsn, namespace, deadlock_timeout, workers) -> None:  # type: ignore[no-untyped-def]
    """Here, A waits in process for C, which waits on the server for the child's D; there,
    D waits in process for E, which waits on the server for A. Each process sees its own
    waits in process only: the looks publish them on the server for the other's. A member
    gets DeadlockError (each of the two waiters in process may), every wait ends, and
    nothing stays held."""
    process = child(dsn, namespace, CYCLE_CHILD, pure=engine.__name__ == "lockmgr._pure")
    outcomes, took = cycle_through_two_processes(pg_locks, process, dsn, workers)
    # The first DeadlockError ended the cycle: the child, the last to finish, was done
    # within the bound (the waiters' first looks publish their waits: half a second).
    assert took < deadlock_timeout + WITHIN + LOOK_EVERY + SLACK, outcomes


def cycle_through_two_processes(manager: postgres.PgLockManager[Any], process: Any, dsn: str,
                                workers: Any) -> tuple[dict[str, object], float]:
    """The cycle of the test above, with ``manager`` here and a child running
    ``CYCLE_CHILD``, checked: the outcomes of A, C, D and E, and the seconds from A's wait
    to the child's end."""
    expect(process, held=True)
    a, c = workers("A"), workers("C")
    a.run(lambda: manager.acquire("a"))
    c.run(lambda: manager.acquire("c"))

    def take_then_give_back(worker_key: str) -> object:
        try:
            outcome: object = manager.acquire(worker_key, timeout=60)
        except DeadlockError:
            outcome = "deadlock"
        manager.release_all()
        return outcome

    c_waits = c.submit(lambda: take_then_give_back("d"))
    c_backend = holders_backend(manager, "c")
    wait_until(lambda: waiting_on_server(dsn, c_backend), "C waits on the server")
    assert process.stdin is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    wait_until(lambda: waits_for_key_on_server(dsn, manager, "a"), "E waits on the server")
    started = time.monotonic()
    a_waits = a.submit(lambda: take_then_give_back("c"))
    said = expect(process)
    ended = time.monotonic()
    outcomes = {"A": a_waits.result(), "C": c_waits.result(), "D": said["d"], "E": said["e"]}
    assert "deadlock" in (outcomes["A"], outcomes["D"]), outcomes
    assert outcomes["C"] is True and outcomes["E"] is True, outcomes
    finish(process)
    return outcomes, ended - started


def waits_for_key_on_server(dsn: str, manager: postgres.PgLockManager[Any], key: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory'"
                           " AND NOT granted AND objsubid = 1"
                           " AND ((classid::bigint << 32) | objid::bigint) = %s)",
                           (manager.advisory_key(key),)).fetchone()
    return bool(row and row[0])


def counting_looks(monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """A semaphore released after each look of a waiting thread (its answer unchanged)."""
    looked = threading.Semaphore(0)
    look = postgres.PgLockManager._in_cycle_through_server

    def counted_look(self: Any, *args: Any) -> bool:
        found = look(self, *args)
        looked.release()
        return found

    monkeypatch.setattr(postgres.PgLockManager, "_in_cycle_through_server", counted_look)
    monkeypatch.setattr(postgres.PgRWLockManager, "_in_cycle_through_server", counted_look)
    return looked


def test_a_many_key_waiter_reading_a_key_beside_a_reader_does_not_wait_for_it(
        engine, dsn, namespace, workers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """M waits in process (acquire_many) for "b", which X holds; it is queued on "a" too,
    which R reads, as M reads it: M does not wait for R. R waits on the server for the
    other process, which waits for "c" on M's connection: no cycle, and M looks again and
    again without being refused, and gets both keys once X lets go."""
    looked = counting_looks(monkeypatch)
    locks: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    other = OtherProcess(dsn, locks)  # type: ignore[arg-type]
    x, r, m = workers("X"), workers("R"), workers("M")
    try:
        x.run(lambda: locks.acquire_write("b"))
        other.hold("d")
        r.run(lambda: locks.acquire_read("a"))
        r_waits = r.submit(lambda: locks.acquire_write("d"))  # on the server, for the other
        m.run(lambda: locks.acquire_write("c"))
        other.wait_for("c")  # on M's connection
        m_waits = m.submit(lambda: locks.acquire_many(reads=["a"], writes=["b"]))
        for _ in range(3):  # three looks that asked the server
            assert looked.acquire(timeout=PATIENCE)
        assert not m_waits.done()
        x.run(lambda: locks.release_write("b"))
        assert m_waits.result() is True
        m.run(locks.release_all)  # the other process gets "c"...
        other.let_go()  # ... and lets "d" go to R
        assert r_waits.result() is True
        r.run(locks.release_all)
    finally:
        other.conn.close()
        locks.close()


def test_a_cycle_through_the_waiters_own_xact_lock_transaction_is_found(
        pg_locks, dsn, deadlock_timeout, workers) -> None:  # type: ignore[no-untyped-def]
    """A took "a" with xact_lock (its transaction still open) and waits in process for "c";
    C holds "c" and waits on the server for "a": A's transaction's connection is A's too."""
    conn = psycopg.connect(dsn)
    a, c = workers("A"), workers("C")
    try:
        c.run(lambda: pg_locks.acquire("c"))

        def a_takes_a_then_c() -> object:
            with conn.transaction():
                with pg_locks.xact_lock(conn, "a"):
                    pass
                c_waits.append(c.submit(lambda: pg_locks.acquire("a")))
                c_backend = holders_backend(pg_locks, "c")
                wait_until(lambda: waiting_on_server(dsn, c_backend), "C waits on the server")
                started = time.monotonic()
                with pytest.raises(DeadlockError, match="through PostgreSQL"):
                    pg_locks.acquire("c")
                return time.monotonic() - started

        c_waits: list[Any] = []
        assert a.run(a_takes_a_then_c) < deadlock_timeout + WITHIN + SLACK  # type: ignore[operator]
        assert c_waits[0].result() is True  # committed: "a" went with the transaction
        c.run(pg_locks.release_all)
    finally:
        conn.close()


def test_a_manager_made_in_another_thread_meanwhile_leaves_a_waiters_looks_alone(
        pg_locks, dsn, namespace, workers) -> None:  # type: ignore[no-untyped-def]
    """A look walks every manager of the process: one being made in another thread, held
    at the end of its construction, is either not there yet or whole."""
    in_window, leave_window = threading.Event(), threading.Event()

    def pause(frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and frame.f_code is _PgEngine.__init__.__code__:
            in_window.set()
            leave_window.wait(PATIENCE)
        return pause

    def make() -> None:
        sys.settrace(pause)
        try:
            postgres.PgLockManager(dsn, namespace=namespace + "-other").close()
        finally:
            sys.settrace(None)

    holder, waiter = workers("holder"), workers("waiter")
    maker = threading.Thread(target=make)
    try:
        holder.run(lambda: pg_locks.acquire("k"))
        waiter.run(lambda: pg_locks.acquire("j"))  # a connection: its looks ask the server
        maker.start()
        assert in_window.wait(PATIENCE)
        assert waiter.run(lambda: pg_locks.acquire("k", timeout=1.2)) is False  # two looks
    finally:
        leave_window.set()
        maker.join(PATIENCE)
        holder.run(pg_locks.release_all)
        waiter.run(pg_locks.release_all)


def outcome_of(manager: postgres.PgLockManager[Any], key: str) -> object:
    """Take ``key`` (for a while at most), give everything back: True, False or the error."""
    try:
        outcome: object = manager.acquire(key, timeout=PATIENCE)
    except DeadlockError as error:
        outcome = error
    manager.release_all()
    return outcome


def test_a_publication_that_no_longer_holds_makes_no_cycle(
        pg_locks, workers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """W waits in process for "k", held by H1 with H2 queued ahead: its look publishes
    (W's connection, H1's) and (W's, H2's). H1 lets "k" go to H2 and then waits in process
    for V, which waits in process for W ("x"). The waits are V -> W -> H2 and H1 -> V: no
    cycle, and all of them get their keys once H2 lets go. But until W looks again its
    publication still says W waits for H1: V's looks (and H1's) follow it back to V.
    W's next look is held back here, as a loaded machine's late look would be."""
    h1, h2, w, v = workers("H1"), workers("H2"), workers("W"), workers("V")
    looks: dict[int | None, int] = {}
    looked = threading.Condition()
    hold_w, let_w_go = threading.Event(), threading.Event()
    look = _PgEngine._in_cycle_through_server

    def counted_look(self: Any, *args: Any) -> bool:
        if threading.get_ident() == w.thread.ident and hold_w.is_set():
            let_w_go.wait(PATIENCE)
        found = look(self, *args)
        with looked:
            looks[threading.get_ident()] = looks.get(threading.get_ident(), 0) + 1
            looked.notify_all()
        return found

    def looked_times(worker: Any, times: int) -> None:
        with looked:
            assert looked.wait_for(lambda: looks.get(worker.thread.ident, 0) >= times, PATIENCE)

    monkeypatch.setattr(postgres.PgLockManager, "_in_cycle_through_server", counted_look)
    h2_lets_go = threading.Event()

    def h2_takes_k() -> object:
        outcome = pg_locks.acquire("k", timeout=PATIENCE)
        h2_lets_go.wait(PATIENCE)
        pg_locks.release_all()
        return outcome

    try:
        h1.run(lambda: pg_locks.acquire("h1"))  # (a connection that stays its)
        h1.run(lambda: pg_locks.acquire("k"))
        h2.run(lambda: pg_locks.acquire("h2"))
        h2_waits = h2.submit(h2_takes_k)
        wait_until(lambda: waits_in_process(pg_locks, "k"), "H2 waits in process")
        w.run(lambda: pg_locks.acquire("x"))
        w_waits = w.submit(lambda: outcome_of(pg_locks, "k"))
        looked_times(w, 1)  # W published that it waits for H1 and H2
        hold_w.set()
        v.run(lambda: pg_locks.acquire("v"))
        v_waits = v.submit(lambda: outcome_of(pg_locks, "x"))
        h1.run(lambda: pg_locks.release("k"))  # H2 gets "k"
        h1_waits = h1.submit(lambda: outcome_of(pg_locks, "v"))
        wait_until(lambda: any(state.key == "v" and state.waiters
                               for state in pg_locks.snapshot()), "H1 waits in process for V")
        wait_until(lambda: looks.get(v.thread.ident, 0) >= 2 or v_waits.done(),
                   "V looked twice, or its wait ended")
    finally:
        let_w_go.set()
        h2_lets_go.set()
    outcomes = {"W": w_waits.result(), "V": v_waits.result(), "H1": h1_waits.result()}
    assert h2_waits.result() is True
    assert outcomes == {"W": True, "V": True, "H1": True}, outcomes


@pytest.mark.parametrize("otherwise", ["application name", "time zone"])
def test_a_cycle_through_a_manager_of_the_same_server_under_another_dsn_is_found(
        pg_locks, other, dsn, namespace, deadlock_timeout, workers, otherwise) -> None:  # type: ignore[no-untyped-def]
    """The first cycle of this module, C's wait on the server made through a second
    manager of the same namespace on the same server, whose DSN names an
    application_name, or whose sessions have another time zone: the same server, the
    same locks, the same cycle."""
    spelled_otherwise: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn + "?application_name=another-spelling", namespace=namespace
    ) if otherwise == "application name" else postgres.PgLockManager(
        dsn, namespace=namespace, connect_kwargs={"options": "-c TimeZone=Asia/Tokyo"})
    a, c = workers("A"), workers("C")
    try:
        a.run(lambda: pg_locks.acquire("a"))
        c.run(lambda: pg_locks.acquire("c"))
        other.hold("b")
        other.wait_for("a")
        c_waits = c.submit(lambda: spelled_otherwise.acquire("b"))
        wait_until(lambda: any(
            waiting_on_server(dsn, pid) for _, pid, _ in connections_of(spelled_otherwise)),
            "C waits on the server")
        try:
            outcome: object = a.run(lambda: pg_locks.acquire(
                "c", timeout=deadlock_timeout + WITHIN + SLACK))
        except DeadlockError as error:
            outcome = error
        a.run(pg_locks.release_all)
        other.let_go()
        assert c_waits.result() is True
        c.run(spelled_otherwise.release_all)
        c.run(pg_locks.release_all)
        assert isinstance(outcome, DeadlockError), outcome
    finally:
        spelled_otherwise.close()


def published_waits(dsn: str) -> int:
    """How many waits in process are published on the server (lockmgr's reserved keys)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
            f" AND classid::bigint >= {PUBLISHED}"
            f" AND classid::bigint < {PUBLISHED + PUBLISHABLE_PIDS}").fetchone()
    return int(row[0]) if row else 0


def test_the_waiters_of_a_hot_key_share_one_connection_for_their_looks(
        pg_locks, dsn, workers) -> None:  # type: ignore[no-untyped-def]
    """Ten threads, each holding a key, wait in process for one held key: their looks
    publish one wait each (to the holder) on one connection of the manager's, which
    closes, with what it published, once they are served."""
    holder = workers("holder")
    holder.run(lambda: pg_locks.acquire("hot"))
    waiters = [workers(f"waiter {number}") for number in range(10)]
    for number, waiter in enumerate(waiters):
        waiter.run(lambda number=number: pg_locks.acquire(f"own {number}"))  # type: ignore[misc]
    waiting = [waiter.submit(lambda: outcome_of(pg_locks, "hot")) for waiter in waiters]
    wait_until(lambda: published_waits(dsn) == len(waiters), "each waiter published its wait")
    lookout_backend = pg_locks._lookout.link.backend
    assert lookout_backend not in {pid for _, pid, _ in connections_of(pg_locks)}
    holder.run(pg_locks.release_all)
    assert [wait.result() for wait in waiting] == [True] * len(waiters)  # each let go of all
    assert pg_locks._lookout.link is None
    # (the server ends the closed connection's session, and so its locks, a moment later)
    wait_until(lambda: published_waits(dsn) == 0, "the lookout's session ended")


@pytest.mark.parametrize("held", ["before it publishes", "after its round trip"])
def test_a_task_whose_wait_ends_during_its_look_leaves_nothing_published(
        pg_locks, dsn, workers, monkeypatch, held) -> None:  # type: ignore[no-untyped-def]
    """A task's look runs in a thread of the manager's: the task, cancelled once the look
    has read what to publish, or once it has published it and checked its wait, ends its
    wait meanwhile. The look takes it back, and the connection closes: nothing stays
    published."""
    entered, go_on = threading.Event(), threading.Event()

    def hold(found: Any) -> Any:
        entered.set()
        assert go_on.wait(PATIENCE)
        return found

    if held == "before it publishes":
        look_sql = _deadlock.look_sql
        monkeypatch.setattr(_deadlock, "look_sql", lambda *args: hold(look_sql(*args)))
    else:
        look = Lookout._look
        monkeypatch.setattr(Lookout, "_look", lambda *args: hold(look(*args)))
    holder = workers("holder")
    holder.run(lambda: pg_locks.acquire("hot"))
    looked: list[bool] = []

    async def waits_holding_a_key() -> None:
        await pg_locks.aio.acquire("own")
        try:
            await pg_locks.aio.acquire("hot")
        finally:
            await pg_locks.aio.release("own")

    async def main() -> None:
        waiting = asyncio.create_task(waits_holding_a_key())
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, PATIENCE)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        go_on.set()
        await until(lambda: not looked and pg_locks._lookout.lock.acquire(blocking=False)
                    and (pg_locks._lookout.lock.release() or True), "the look ended")
        looked.append(True)

    run(main)
    assert pg_locks._lookout.link is None and not pg_locks._lookout.published
    wait_until(lambda: published_waits(dsn) == 0, "the lookout's session ended")
    holder.run(pg_locks.release_all)


# -- whose publications count --------------------------------------------------------------------

FORGER = "lockmgr_forger"


@pytest.fixture(scope="module")
def forging_logins(dsn: str) -> dict[str, str]:
    """DSNs of logins an attacker may have on the managers' server: another role on their
    database, their role on another database, and the other role there."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {FORGER} LOGIN")
        admin.execute("CREATE DATABASE forgery")
    return {"another role": make_conninfo(dsn, user=FORGER),
            "another database": make_conninfo(dsn, dbname="forgery"),
            "another role on another database": make_conninfo(dsn, user=FORGER,
                                                              dbname="forgery")}


class Forger:
    """A session that publishes, as a lookout would, that the backend ``waiter`` waits in
    process for the backend ``holder``, and stamps its publication anew every 20 ms (as
    often as a busy lookout would), until the ``with`` block ends."""

    def __init__(self, dsn: str, waiter: int, holder: int) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.conn.execute("SELECT pg_advisory_lock_shared(%s, %s), pg_advisory_lock_shared(%s, 0)",
                          (PUBLISHED + waiter, holder, STAMPED))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.stamp_anew)

    def stamp_anew(self) -> None:
        stamp = 0
        while not self.stop.wait(0.02):
            self.conn.execute("SELECT pg_advisory_unlock_shared(%s, %s),"
                              " pg_advisory_lock_shared(%s, %s)",
                              (STAMPED, stamp, STAMPED, stamp + 1))
            stamp += 1

    def __enter__(self) -> Forger:
        self.thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.thread.join(PATIENCE)
        self.conn.close()


def counting_answered_looks(monkeypatch: pytest.MonkeyPatch) -> threading.Semaphore:
    """A semaphore released after each look, of a thread or a task, that the server
    answered (its answer unchanged)."""
    looked = threading.Semaphore(0)
    look = Lookout.look

    def counted_look(self: Lookout, *args: Any) -> bool | None:
        found = look(self, *args)
        if found is not None:
            looked.release()
        return found

    monkeypatch.setattr(Lookout, "look", counted_look)
    return looked


def take_c_holding_a(manager: postgres.PgLockManager[Any], as_task: bool,
                     holds_a: threading.Event, go: threading.Event) -> object:
    """Take "a", set ``holds_a``, once ``go`` is set take "c" (for a while at most), and
    give everything back: the outcome (True, False or the error). As a thread, or a task of
    a loop of the calling thread's."""
    if not as_task:
        manager.acquire("a")
        holds_a.set()
        assert go.wait(PATIENCE)
        return outcome_of(manager, "c")

    async def task() -> object:
        await manager.aio.acquire("a")
        holds_a.set()
        await until(go.is_set, "told to go")
        try:
            outcome: object = await manager.aio.acquire("c", timeout=PATIENCE)
        except DeadlockError as error:
            outcome = error
        await manager.aio.release_all()
        return outcome

    return asyncio.run(asyncio.wait_for(task(), PATIENCE * 3))


def looking_while_a_wait_is_forged(manager: postgres.PgLockManager[Any], dsn: str,
                                   forging_login: str, as_task: bool, workers: Any,
                                   looked: threading.Semaphore) -> object:
    """A holds "a", C holds "c" and waits on the server for "b", which another process
    holds; a forger publishes that the other process waits in process for A, and A waits
    in process for "c": if its looks followed the forgery, the cycle would close. Once A
    has looked (an answer) three times since, or its wait has ended, the other process lets
    "b" go to C, which lets "c" go: A's outcome."""
    other = OtherProcess(dsn, manager)
    a, c = workers("A"), workers("C")
    holds_a, go = threading.Event(), threading.Event()
    try:
        c.run(lambda: manager.acquire("c"))
        c_waits = c_waits_on_the_server(manager, other, c, hold_a=False)

        def a_takes_c() -> object:
            try:
                return take_c_holding_a(manager, as_task, holds_a, go)
            finally:
                looked.release()  # A's wait ended: the count below stops waiting for looks

        a_waits = a.submit(a_takes_c)
        assert holds_a.wait(PATIENCE)
        with Forger(forging_login, other.pid, holders_backend(manager, "a")):
            go.set()
            wait_until(lambda: waits_in_process(manager, "c") or a_waits.done(),
                       "A waits in process")
            for _ in range(3):  # two of them at least began with the forgery in place
                if not looked.acquire(timeout=PATIENCE) or a_waits.done():
                    break
        other.let_go()
        assert c_waits.result() is True
        c.run(manager.release_all)
        outcome = a_waits.result()
    finally:
        go.set()
        other.conn.close()
    return outcome


@pytest.mark.parametrize("owner", ["thread", "task"])
@pytest.mark.parametrize("login", ["another role", "another database",
                                   "another role on another database"])
def test_a_wait_published_by_a_session_of_another_role_or_database_is_not_followed(
        pg_locks, dsn, forging_logins, workers, monkeypatch, login, owner) -> None:  # type: ignore[no-untyped-def]
    """Advisory locks need no privilege: anyone who can log in can take the keys that
    publish waits. A manager's looks follow only the publications of its own database and
    role: the forged wait closes no cycle, and A waits on until C lets go."""
    looked = counting_answered_looks(monkeypatch)
    outcome = looking_while_a_wait_is_forged(
        pg_locks, dsn, forging_logins[login], owner == "task", workers, looked)
    assert outcome is True


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_wait_published_by_a_session_of_a_trusted_role_is_followed(
        engine, dsn, namespace, forging_logins, workers, monkeypatch, owner) -> None:  # type: ignore[no-untyped-def]
    """A manager told to trust another role (``trusted_roles``) follows that role's
    publications on its database: the same forgery closes the cycle, and A is refused."""
    looked = counting_answered_looks(monkeypatch)
    trusting: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, trusted_roles=[FORGER])
    try:
        outcome = looking_while_a_wait_is_forged(
            trusting, dsn, forging_logins["another role"], owner == "task", workers, looked)
    finally:
        trusting.close()
    assert isinstance(outcome, DeadlockError), outcome


@pytest.mark.parametrize("roles, error", [
    ("lockmgr", TypeError), ([b"lockmgr"], TypeError), ([""], ValueError),
    (["lock\x00mgr"], ValueError)])
def test_trusted_roles_must_be_names(engine, dsn, roles, error) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match="trusted_roles"):
        postgres.PgLockManager(dsn, trusted_roles=roles)
    with pytest.raises(error, match="trusted_roles"):
        postgres.PgRWLockManager(dsn, trusted_roles=roles)


# -- publications that outlive their waits ---------------------------------------------------------

GIVEN_UP_LOOKOUT_CHILD = """
results = {}
h_holds, w_has_h = threading.Event(), threading.Event()
steps = {step: threading.Event() for step in ("let h go", "h waits for a", "end")}

def thread_h():
    locks.acquire("h")
    h_holds.set()
    steps["let h go"].wait()
    locks.release("h")
    steps["h waits for a"].wait()
    results["h"] = locks.acquire("a", timeout=60)  # waits on the server for the parent's A
    locks.release_all()

def thread_w():
    locks.acquire("w")
    results["w"] = locks.acquire("h", timeout=60)  # waits in process for H: published
    w_has_h.set()
    steps["end"].wait()
    locks.release_all()

h = threading.Thread(target=thread_h)
h.start()
h_holds.wait()
w = threading.Thread(target=thread_w)
w.start()
say(started=True)
steps[sys.stdin.readline().strip()].set()  # let h go
w_has_h.wait()
deadline = time.monotonic() + 30
while locks._lookout.link is not None and time.monotonic() < deadline:
    time.sleep(0.01)
say(lookout_closed=locks._lookout.link is None)
steps[sys.stdin.readline().strip()].set()  # h waits for a
steps[sys.stdin.readline().strip()].set()  # end
h.join()
w.join()
say(**results)
sys.stdin.readline()
"""


def publishers(dsn: str) -> set[int]:
    """The backend pids of the sessions that publish waits in process."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {row[0] for row in conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
            f" AND classid::bigint >= {PUBLISHED}"
            f" AND classid::bigint < {PUBLISHED + PUBLISHABLE_PIDS}")}


def tell(process: Any, step: str) -> None:
    assert process.stdin is not None
    process.stdin.write(step + "\n")
    process.stdin.flush()


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_wait_published_by_a_lookout_given_up_closes_no_cycle(
        engine, pg_locks, dsn, namespace, workers, monkeypatch, owner) -> None:  # type: ignore[no-untyped-def]
    """There, W holds "w" and waits in process for H: its look publishes the wait. Its
    lookout's backend then stops answering (SIGSTOP); H lets "h" go to W, whose wait ends,
    and the child gives the lookout up, but the stopped session keeps the publication. H
    waits on the server for A's "a". Here, C holds "c" and waits on the server for W's "w",
    and A waits in process for "c". Following the stale publication, A -> C -> W -> H -> A
    would be a cycle; there is none (W waits for nothing), and A is not refused: it gets
    "c" once W lets go, and every wait ends."""
    looked = counting_answered_looks(monkeypatch)
    process = child(dsn, namespace, GIVEN_UP_LOOKOUT_CHILD, pure=engine.__name__ == "lockmgr._pure")
    expect(process, started=True)
    wait_until(lambda: len(publishers(dsn)) == 1, "W's wait is published")
    [lookout] = publishers(dsn)
    a, c = workers("A"), workers("C")
    holds_a, go = threading.Event(), threading.Event()
    os.kill(lookout, signal.SIGSTOP)
    try:
        tell(process, "let h go")
        expect(process, lookout_closed=True)
        assert publishers(dsn) == {lookout}  # the stopped session still publishes W's wait
        a_waits = a.submit(lambda: take_c_holding_a(pg_locks, owner == "task", holds_a, go))
        assert holds_a.wait(PATIENCE)
        c.run(lambda: pg_locks.acquire("c"))
        c_waits = c.submit(lambda: outcome_of(pg_locks, "w"))
        wait_until(lambda: waiting_on_server(dsn, holders_backend(pg_locks, "c")),
                   "C waits on the server")
        tell(process, "h waits for a")
        wait_until(lambda: waits_for_key_on_server(dsn, pg_locks, "a"), "H waits on the server")
        go.set()
        wait_until(lambda: waits_in_process(pg_locks, "c") or a_waits.done(),
                   "A waits in process")
        for _ in range(3):  # A looks three times (each answered), or is refused
            if not looked.acquire(timeout=PATIENCE) or a_waits.done():
                break
        tell(process, "end")  # W lets "w" go to C, which lets "c" go to A, then "a" to H
        assert expect(process) == {"w": True, "h": True}
        assert c_waits.result() is True
        assert a_waits.result() is True
        finish(process)
    finally:
        go.set()
        os.kill(lookout, signal.SIGCONT)


# -- cycles through xact_lock transactions -----------------------------------------------------------

@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_cycle_through_an_xact_lock_transaction_waiting_on_the_server_is_found(
        pg_locks, dsn, workers, owner) -> None:  # type: ignore[no-untyped-def]
    """A holds "a"; C holds "c", and in its own transaction waits with xact_lock for "a";
    A waits in process for "c": A -> C -> C's transaction -> A. A is refused, C's
    transaction gets "a"."""
    conn = psycopg.connect(dsn)
    a, c = workers("A"), workers("C")
    holds_a, go = threading.Event(), threading.Event()
    try:
        a_waits = a.submit(lambda: take_c_holding_a(pg_locks, owner == "task", holds_a, go))
        assert holds_a.wait(PATIENCE)
        c.run(lambda: pg_locks.acquire("c"))

        def c_takes_a_in_its_transaction() -> bool:
            with conn.transaction():
                with pg_locks.xact_lock(conn, "a", timeout=PATIENCE):
                    return True

        transaction_backend = conn.info.backend_pid
        c_waits = c.submit(c_takes_a_in_its_transaction)
        wait_until(lambda: waiting_on_server(dsn, transaction_backend),
                   "C's transaction waits on the server")
        go.set()
        outcome = a_waits.result()
        assert c_waits.result() is True  # A let "a" go, refused or not
        c.run(pg_locks.release_all)
        assert isinstance(outcome, DeadlockError), outcome
    finally:
        go.set()
        conn.close()


XACT_CYCLE_CHILD = """
import psycopg
results = {}
e_holds, e_go, d_holds = threading.Event(), threading.Event(), threading.Event()

def thread_e():
    locks.acquire("e")
    e_holds.set()
    e_go.wait()
    with psycopg.connect(os.environ["DSN"]) as conn:
        try:
            with conn.transaction():
                with locks.xact_lock(conn, "a", timeout=60):  # waits for the parent's A
                    results["e"] = True
        except DeadlockError:
            results["e"] = "deadlock"
    locks.release_all()

e = threading.Thread(target=thread_e)
e.start()
e_holds.wait()
with psycopg.connect(os.environ["DSN"]) as conn:
    with conn.transaction():
        with locks.xact_lock(conn, "d"):  # D holds "d" in its transaction only
            pass
        say(held=True, transaction=conn.info.backend_pid)
        sys.stdin.readline()
        e_go.set()
        try:
            results["d"] = locks.acquire("e", timeout=60)  # waits in process for E
        except DeadlockError:
            results["d"] = "deadlock"
        locks.release_all()
e.join()
say(**results)
"""


def test_a_cycle_through_xact_lock_transactions_of_two_processes_is_found(
        engine, pg_locks, dsn, namespace, workers) -> None:  # type: ignore[no-untyped-def]
    """Here, A waits in process for C, which waits on the server for the child's D; there,
    D, which holds "d" in its transaction only, waits in process for E, whose transaction
    waits on the server for A. The waits published there are those of D's transaction, for
    E's transaction: a member gets DeadlockError, every wait ends, nothing stays held."""
    process = child(dsn, namespace, XACT_CYCLE_CHILD, pure=engine.__name__ == "lockmgr._pure")
    transaction = expect(process, held=True)["transaction"]
    a, c = workers("A"), workers("C")
    a.run(lambda: pg_locks.acquire("a"))
    c.run(lambda: pg_locks.acquire("c"))

    def take_then_give_back(key: str) -> object:
        try:
            outcome: object = pg_locks.acquire(key, timeout=60)
        except DeadlockError:
            outcome = "deadlock"
        pg_locks.release_all()
        return outcome

    c_waits = c.submit(lambda: take_then_give_back("d"))
    wait_until(lambda: waiting_on_server(dsn, holders_backend(pg_locks, "c")),
               "C waits on the server")
    tell(process, "go")
    wait_until(lambda: waits_for_key_on_server(dsn, pg_locks, "a"), "E waits on the server")
    a_waits = a.submit(lambda: take_then_give_back("c"))
    said = expect(process)
    outcomes = {"A": a_waits.result(), "C": c_waits.result(), "D": said["d"], "E": said["e"]}
    assert "deadlock" in (outcomes["A"], outcomes["D"]), outcomes
    assert outcomes["C"] is True and outcomes["E"] is True, outcomes
    assert not waiting_on_server(dsn, transaction)
    finish(process)


@pytest.fixture(scope="module")
def application_roles(dsn: str) -> tuple[str, str]:
    """Two roles, neither a superuser, that two applications log in as."""
    roles = ("lockmgr_app_here", "lockmgr_app_there")
    with psycopg.connect(dsn, autocommit=True) as admin:
        for role in roles:
            admin.execute(f"CREATE ROLE {role} LOGIN")
    return roles


def test_a_cycle_through_two_processes_of_two_roles_that_trust_each_other_is_found(
        engine, dsn, namespace, application_roles, workers) -> None:  # type: ignore[no-untyped-def]
    """The cycle through the waits in process of two processes, whose managers log in as
    two roles, neither a superuser (each sees of the other's sessions only their role,
    database and locks), each trusting the other's: a member gets DeadlockError."""
    here, there = application_roles
    manager: postgres.PgLockManager[Any] = postgres.PgLockManager(
        make_conninfo(dsn, user=here), namespace=namespace, trusted_roles=[there])
    trusting = (f"locks.close()\nlocks = postgres.PgLockManager(os.environ['DSN'],"
                f" namespace=os.environ['NAMESPACE'], trusted_roles=[{here!r}])\n")
    try:
        process = child(make_conninfo(dsn, user=there), namespace, trusting + CYCLE_CHILD,
                        pure=engine.__name__ == "lockmgr._pure")
        cycle_through_two_processes(manager, process, dsn, workers)
    finally:
        manager.close()
