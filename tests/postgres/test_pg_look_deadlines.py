"""A timed wait in process returns by its deadline, plus the documented half second, whatever
its deadlock looks meet on the server: a look's round trip and its connect end at the wait's
deadline too (``_deadlock``: ``Look.deadline``), for threads and tasks alike. Against a real
server whose backend, or postmaster, is stopped (SIGSTOP: the kernel still acknowledges the
packets, so only a deadline on the client ends the wait)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pgserver  # noqa: F401  (first: it skips this module where psycopg cannot load libpq)
import psycopg
from conftest import PATIENCE, Worker, wait_until
from lockmgr import postgres
from lockmgr.postgres import _deadlock
from lockmgr.postgres._deadlock import connections_of

pytestmark = [pytest.mark.usefixtures("nothing_left_held", "children_reaped"),
              pytest.mark.posix_only]

TIMEOUT = 1.0  # the waiter's: its first look comes at LOOK_EVERY (0.5 s), within it
# Slack for a loaded 2-core machine on top of the documented half second; an unbounded look
# takes LOOK_FOR, made far longer here, or a connect's psycopg default (130 s).
SLACK = 5.0


def backend_of(manager: postgres.PgLockManager[Any], owner: object) -> int:
    [pid] = [pid for holder, pid, _ in connections_of(manager) if holder == owner]
    return pid


def postmaster_of(backend: int) -> int:
    with open(f"/proc/{backend}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("PPid:"))


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def gone(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                           (pid,)).fetchone()
    return row == (0,)


class Waiter:
    """A thread, or a task on a loop in a thread of its own, holding "w" (so that its looks
    ask the server) that waits in process for "x", with TIMEOUT, once told to; ``took``:
    how long that wait took, set as it returns (and ``returned`` set)."""

    def __init__(self, locks: postgres.PgLockManager[Any], owner: str) -> None:
        self.locks = locks
        self.holding = threading.Event()
        self.go = threading.Event()
        self.returned = threading.Event()
        self.got: list[object] = []
        self.took = 0.0
        self.ident: object = None
        body: Callable[[], object] = self.as_thread if owner == "thread" else (
            lambda: asyncio.run(self.as_task()))
        self.worker = Worker("waiter")
        self.call = self.worker.submit(body)

    def as_thread(self) -> None:
        locks = self.locks
        locks.acquire("w")
        self.ident = threading.get_ident()
        self.holding.set()
        self.go.wait(PATIENCE)
        began = time.monotonic()
        self.got.append(locks.acquire("x", timeout=TIMEOUT))
        self.took = time.monotonic() - began
        self.returned.set()
        locks.release("w")

    async def as_task(self) -> None:
        aio = self.locks.aio
        await aio.acquire("w")
        self.ident = asyncio.current_task()
        self.holding.set()
        while not self.go.is_set():
            await asyncio.sleep(0.01)
        began = time.monotonic()
        self.got.append(await aio.acquire("x", timeout=TIMEOUT))
        self.took = time.monotonic() - began
        self.returned.set()
        await aio.release("w")


@pytest.mark.parametrize("what_stops", ["borrowed backend", "postmaster"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_timed_wait_in_process_returns_by_its_deadline_whatever_its_looks_meet(
        engine, dsn, namespace, owner, what_stops, monkeypatch) -> None:
    """A thread of this process holds "x"; the waiter, holding "w", waits in process for it
    with a timeout, and looks for a cycle through the server meanwhile. The look's
    connection is a stopped backend (an idle one of the manager's, borrowed), or it has to
    connect, to a stopped postmaster. The wait still times out by its deadline plus the
    documented half second: before, a look waited LOOK_FOR (1 s, made 30 s here) plus a
    cancel's grace for a stopped backend (acquire(x, timeout=0.6) returned after 1.76 s),
    and psycopg's connect timeout for a stopped postmaster (8 s and more)."""
    monkeypatch.setattr(_deadlock, "LOOK_FOR", 30.0)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holder = Worker("holder")
    waiter: Waiter | None = None
    try:
        assert holder.run(lambda: locks.acquire("x")) is True
        waiter = Waiter(locks, owner)
        assert waiter.holding.wait(PATIENCE)
        if what_stops == "borrowed backend":  # an idle connection, which the look borrows
            spare = Worker("spare")
            spare.run(lambda: (locks.acquire("spare"), locks.release("spare")))
            spare.stop()
            [idle] = locks._idle
            stopping = idle.backend
        else:  # no idle connection: the look connects
            assert not locks._idle
            stopping = postmaster_of(backend_of(locks, holder.thread.ident))
        with stopped(stopping):
            waiter.go.set()
            returned = waiter.returned.wait(TIMEOUT + SLACK)
        assert returned, f"the wait had not returned {TIMEOUT + SLACK:g} s after its call"
        assert waiter.got == [False]
        assert waiter.took < TIMEOUT + SLACK
        waiter.call.result()  # (it released "w")
        if what_stops == "borrowed backend":  # the look closed it: the server ends it
            wait_until(lambda: gone(dsn, stopping), "the stopped backend ends")
    finally:
        if waiter is not None:
            waiter.go.set()
            waiter.call.wait(PATIENCE * 3)
            waiter.worker.stop()
        holder.run(locks.release_all)
        holder.stop()
        locks.close()


def test_a_tasks_timed_wait_is_not_held_up_by_another_waiters_look(
        engine, dsn, namespace, monkeypatch) -> None:
    """Two tasks wait in process for "x", which a thread holds: the first without a timeout,
    its look stalled on a stopped backend; the second with one. The tasks' looks run in one
    thread of the manager's, so the second's look is queued behind the first's: its wait
    still times out by its deadline plus the documented half second (before, it waited for
    the first look to end: LOOK_FOR, made 30 s here)."""
    monkeypatch.setattr(_deadlock, "LOOK_FOR", 30.0)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holder, loop_thread = Worker("holder"), Worker("loop")
    holding, go_first, go_second, returned = (threading.Event() for _ in range(4))
    took: list[float] = []

    async def first() -> None:
        await locks.aio.acquire("w1")
        while not go_first.is_set():
            await asyncio.sleep(0.01)
        assert await locks.aio.acquire("x") is True  # once the holder lets go
        await locks.aio.release_all()

    async def second() -> None:
        await locks.aio.acquire("w2")
        while not go_second.is_set():
            await asyncio.sleep(0.01)
        began = time.monotonic()
        assert await locks.aio.acquire("x", timeout=TIMEOUT) is False
        took.append(time.monotonic() - began)
        returned.set()
        await locks.aio.release("w2")

    async def both() -> None:
        tasks = [asyncio.create_task(first()), asyncio.create_task(second())]
        await asyncio.sleep(0)
        while len(connections_of(locks)) < 3:  # the holder's, and one per task
            await asyncio.sleep(0.01)
        holding.set()
        await asyncio.gather(*tasks)

    stopping = 0
    try:
        assert holder.run(lambda: locks.acquire("x")) is True
        waiting = loop_thread.submit(lambda: asyncio.run(both()))
        assert holding.wait(PATIENCE)
        spare = Worker("spare")  # an idle connection, which the first look borrows
        spare.run(lambda: (locks.acquire("spare"), locks.release("spare")))
        spare.stop()
        [idle] = locks._idle
        stopping = idle.backend
        with stopped(stopping):
            go_first.set()
            wait_until(locks._lookout.lock.locked, "the first task's look is under way")
            go_second.set()
            assert returned.wait(TIMEOUT + SLACK), (
                f"the timed wait had not returned {TIMEOUT + SLACK:g} s after its call")
        assert took[0] < TIMEOUT + SLACK
        holder.run(locks.release_all)
        waiting.result(PATIENCE * 3)
    finally:
        go_first.set()
        go_second.set()
        holder.run(locks.release_all)
        holder.stop()
        loop_thread.stop(PATIENCE * 3, check=False)
        if stopping:
            wait_until(lambda: gone(dsn, stopping), "the stopped backend ends")
        locks.close()
