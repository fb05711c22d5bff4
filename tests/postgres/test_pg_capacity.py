"""``max_connections``: a manager's threads and tasks share at most that many connections, and
wait in line for one beyond it (first come, first served, within their timeouts), against
real servers — one of them with a small ``max_connections`` of its own."""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pgserver  # first: it skips this module where psycopg cannot load libpq
import psycopg
from conftest import PATIENCE, wait_until
from lockmgr import AbandonedLockWarning, LockTimeout, postgres
from lockmgr.postgres import _capacity, _tasks
from lockmgr.postgres._deadlock import live_managers
from pg_support import (
    held_on_server, in_loop_thread, own_sessions_locks, quietly_collect, run, until,
)

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")

SERVER_LIMIT = 20  # the small server's max_connections
HOLDERS = 25  # more than it takes


@pytest.fixture(scope="module")
def small_dsn() -> Iterator[str]:
    """A server of its own that takes at most SERVER_LIMIT connections."""
    with pgserver.running_server(f"max_connections={SERVER_LIMIT}") as running:
        yield running


def capped(engine: Any, dsn: str, namespace: str, limit: int,
           cls: Any = postgres.PgLockManager) -> Any:
    return cls(dsn, namespace=namespace, max_connections=limit)


def client_backends(dsn: str) -> int:
    """The server's client sessions, but the one asking."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE backend_type ="
                            " 'client backend' AND pid <> pg_backend_pid()").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("cls", [postgres.PgLockManager, postgres.PgRWLockManager])
@pytest.mark.parametrize("value, error", [(0, ValueError), (-3, ValueError), (1.5, TypeError),
                                          ("4", TypeError), (True, TypeError)])
def test_a_bad_max_connections_is_refused_before_anything_is_made(
        engine, dsn, namespace, cls, value, error) -> None:
    before = len(live_managers())
    with pytest.raises(error, match="max_connections must be"):
        cls(dsn, namespace=namespace, max_connections=value)
    assert len(live_managers()) == before


class Peak:
    """How many hold at once, and the most that ever did; ``full`` once ``limit`` hold."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.now = self.most = self.done = 0
        self.full = threading.Event()
        self.backends_at_full = -1

    def enter(self) -> bool:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)
            return self.now == self.limit

    def leave(self) -> None:
        with self.lock:
            self.now -= 1
            self.done += 1


def test_more_holders_than_the_server_takes_all_get_in_through_a_capped_manager(
        engine, small_dsn, namespace) -> None:
    """25 threads and 25 tasks each hold a key of its own on a server that takes 20
    connections, through one manager capped at 10: none fails, and at most 10 hold at once
    (the others wait for a connection to be free)."""
    limit = 10
    locks = capped(engine, small_dsn, namespace, limit)
    peak = Peak(limit)
    failures: list[BaseException] = []

    def holds_while_full(entered_full: bool) -> None:
        if entered_full:
            peak.backends_at_full = client_backends(small_dsn)
            peak.full.set()

    def thread_holder(number: int) -> None:
        try:
            with locks.hold(f"thread {number}", timeout=PATIENCE * 2):
                holds_while_full(peak.enter())
                assert peak.full.wait(PATIENCE)
                peak.leave()
        except BaseException as error:
            failures.append(error)

    async def task_holder(number: int) -> None:
        async with locks.aio.hold(f"task {number}", timeout=PATIENCE * 2):
            if peak.enter():
                await asyncio.to_thread(holds_while_full, True)
            await until(peak.full.is_set, "as many as the cap held at once")
            peak.leave()

    async def tasks() -> None:
        await asyncio.gather(*(task_holder(number) for number in range(HOLDERS)))

    try:
        loop_thread, task_failures = in_loop_thread(tasks)
        threads = [threading.Thread(target=thread_holder, args=(number,))
                   for number in range(HOLDERS)]
        for thread in threads:
            thread.start()
        for thread in [*threads, loop_thread]:
            thread.join(PATIENCE * 3)
        assert not failures and not task_failures, (failures, task_failures)
        assert peak.done == 2 * HOLDERS and peak.most == limit
        assert 0 < peak.backends_at_full <= limit  # on the server too
        assert own_sessions_locks(small_dsn) == 0
    finally:
        locks.close()


def test_a_full_manager_serves_threads_and_tasks_in_the_order_they_came(
        engine, dsn, namespace) -> None:
    """Capped at 1: while the main thread holds, a thread, then a task, then a thread wait
    for the connection; each release gives it to the next in that order."""
    locks = capped(engine, dsn, namespace, 1)
    order: list[str] = []
    go = {name: threading.Event() for name in ("first", "second", "third")}
    failures: list[BaseException] = []

    def thread_waiter(name: str) -> None:
        try:
            with locks.hold(name):
                order.append(name)
                assert go[name].wait(PATIENCE)
        except BaseException as error:
            failures.append(error)

    async def task_waiter() -> None:
        async with locks.aio.hold("second"):
            order.append("second")
            await until(go["second"].is_set, "its turn to release")

    capacity = locks._capacity
    assert locks.acquire("main")
    try:
        first = threading.Thread(target=thread_waiter, args=("first",))
        first.start()
        wait_until(lambda: len(capacity.waiters) == 1, "the first waits for the connection")
        loop_thread, task_failures = in_loop_thread(task_waiter)
        wait_until(lambda: len(capacity.waiters) == 2, "the task waits behind it")
        third = threading.Thread(target=thread_waiter, args=("third",))
        third.start()
        wait_until(lambda: len(capacity.waiters) == 3, "the third waits behind them")
        locks.release("main")
        for name in ("first", "second", "third"):
            wait_until(lambda: order and order[-1] == name, f"{name} holds")
            assert len(capacity.waiters) == 3 - len(order) and capacity.open == 1
            go[name].set()
        for thread in (first, loop_thread, third):
            thread.join(PATIENCE)
        assert order == ["first", "second", "third"]
        assert not failures and not task_failures, (failures, task_failures)
    finally:
        for event in go.values():
            event.set()
        locks.close()


def test_a_timed_wait_for_a_connection_times_out_holding_nothing_and_a_try_does_not_wait(
        engine, dsn, namespace) -> None:
    locks = capped(engine, dsn, namespace, 1)
    results: list[object] = []

    def other_thread() -> None:
        results.append(locks.acquire("b", timeout=0))
        results.append(locks.acquire("b", blocking=False))
        results.append(locks.acquire("b", timeout=0.2))
        try:
            with locks.hold("b", timeout=0.2):
                results.append("held")
        except LockTimeout:
            results.append("LockTimeout")
        results.append(locks.owned("b"))

    assert locks.acquire("a")
    try:
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join(PATIENCE)
        assert results == [False, False, False, "LockTimeout", False]
        assert "b" not in locks and not held_on_server(dsn, locks, "b")
        assert not locks._capacity.waiters and locks._capacity.open == 1
    finally:
        locks.release("a")
    # The place it waited for is free once the holder gives its connection back.
    thread = threading.Thread(target=lambda: results.append(locks.acquire("b", timeout=0)
                                                            and locks.release("b")))
    thread.start()
    thread.join(PATIENCE)
    assert results[-1] is None  # acquired, then released (release returns None)
    locks.close()


def test_a_task_waits_for_a_connection_without_blocking_its_loop(engine, dsn, namespace) -> None:
    """Capped at 1 and held by a thread: a task's timed acquire awaits (another task runs
    meanwhile) and times out holding nothing; a try does not wait; a cancelled wait gives
    up its place."""
    locks = capped(engine, dsn, namespace, 1)
    capacity = locks._capacity
    ticks = 0

    async def main() -> None:
        nonlocal ticks
        aio = locks.aio

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticking = asyncio.create_task(ticker())
        try:
            assert await aio.acquire("b", timeout=0) is False
            before = ticks
            assert await aio.acquire("b", timeout=0.3) is False
            assert ticks > before  # the loop ran while it waited
            with pytest.raises(LockTimeout):
                async with aio.hold("b", timeout=0.2):
                    pass
            waiting = asyncio.create_task(aio.acquire("b"))
            await until(lambda: len(capacity.waiters) == 1, "the task waits for the connection")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert not capacity.waiters and not aio.owned("b")
        finally:
            ticking.cancel()

    assert locks.acquire("a")
    try:
        loop_thread, failures = in_loop_thread(main)
        loop_thread.join(PATIENCE * 3)
        assert not failures, failures
        assert not held_on_server(dsn, locks, "b") and capacity.open == 1
    finally:
        locks.release("a")
        locks.close()


def test_an_idle_connection_of_threads_makes_room_for_a_task_and_back(
        engine, dsn, namespace) -> None:
    """Capped at 1: the threads' idle connection is closed to give its place to a task
    (which does not wait, even trying), and the task's back to a thread."""
    locks = capped(engine, dsn, namespace, 1, postgres.PgRWLockManager)

    async def main() -> None:
        assert await locks.aio.acquire_write("t", timeout=0)
        await locks.aio.release_write("t")

    assert locks.acquire_read("a", timeout=0)
    locks.release_read("a")
    assert idle_of_threads(locks) == 1
    loop_thread, failures = in_loop_thread(main)
    loop_thread.join(PATIENCE * 3)
    assert not failures, failures
    assert idle_of_threads(locks) == 0 and len(locks._task_idle) == 1
    assert locks.acquire_write("a", timeout=0)
    locks.release_write("a")
    assert idle_of_threads(locks) == 1 and not locks._task_idle and locks._capacity.open == 1
    locks.close()


def test_a_connection_a_thread_keeps_goes_to_the_next_thread_at_the_cap(
        engine, dsn, namespace) -> None:
    """Capped at 1: a living thread that holds nothing keeps its connection for its next
    call, and gives it up to another thread (which does not wait, even trying), and back."""
    locks = capped(engine, dsn, namespace, 1)
    its_turn, its_done, its_end = threading.Event(), threading.Event(), threading.Event()
    results: list[bool] = []

    def other() -> None:
        its_turn.wait(PATIENCE)
        results.append(locks.acquire("b", timeout=0))
        locks.release("b")
        its_done.set()
        its_end.wait(PATIENCE)

    thread = threading.Thread(target=other)
    thread.start()
    assert locks.acquire("a", timeout=0)
    locks.release("a")
    its_turn.set()
    assert its_done.wait(PATIENCE) and results == [True]
    assert locks.acquire("a", timeout=0)  # while the other thread lives on
    locks.release("a")
    assert locks._capacity.open == 1
    its_end.set()
    thread.join(PATIENCE)
    locks.close()


def test_a_thread_waiting_in_process_keeps_no_connection_another_needs(
        engine, dsn, namespace) -> None:
    """Capped at 1, two threads take turns on one key: the one waiting in process for the
    other needs no connection, so its kept one goes to the holder, which needs one to
    release on the server; every turn is taken, none waits for a connection to its end."""
    locks = capped(engine, dsn, namespace, 1)
    outcomes: list[bool] = []

    def take_turns() -> None:
        for _ in range(10):
            got = locks.acquire("k", timeout=5)
            outcomes.append(got)
            if not got:
                return
            locks.release("k")

    threads = [threading.Thread(target=take_turns) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    assert outcomes == [True] * 20 and not any(thread.is_alive() for thread in threads)
    locks.close()


def test_a_failed_acquisition_leaves_the_threads_kept_connection_to_others(
        engine, dsn, namespace, workers) -> None:
    """Capped at 2, one thread holds k: the other's try for k fails in process, and its
    kept connection still goes to a third thread at once, and to close()."""
    locks = capped(engine, dsn, namespace, 2)
    holder, third = workers("holder"), workers("third")
    holder.run(lambda: locks.acquire("k"))
    assert locks.acquire("j")  # this thread's connection, kept once it holds nothing
    locks.release("j")
    assert locks.acquire("k", blocking=False) is False
    assert locks.acquire("k", timeout=0.1) is False
    assert third.run(lambda: locks.acquire("other", timeout=PATIENCE)) is True
    third.run(lambda: locks.release("other"))
    holder.run(locks.release_all)
    locks.close()
    assert locks._capacity.open == 0


def idle_of_threads(locks: postgres.PgRWLockManager[Any]) -> int:
    """The threads' connections holding nothing: on the idle list, or kept by the thread
    that last used it (parked) until another needs one."""
    return len(locks._idle) + len(locks._parked)
    assert locks._capacity.open == 0


class Interrupt(BaseException):
    """A signal handler's exception in a task (a KeyboardInterrupt there stops its loop)."""


def interrupt_as_it_returns(monkeypatch: pytest.MonkeyPatch, module: Any, name: str,
                            error: type[BaseException] = KeyboardInterrupt,
                            when: Callable[[Any], bool] = lambda result: True) -> None:
    """``<module>.<name>`` raises ``error`` once as it returns (``when`` its result), as a
    signal handler would at the check CPython makes right after a call."""
    original = getattr(module, name)
    fired = threading.Event()

    def interrupt(result: Any) -> Any:
        if not fired.is_set() and when(result):
            fired.set()
            raise error
        return result

    def interrupted(*args: Any) -> Any:
        return interrupt(original(*args))

    async def interrupted_async(*args: Any) -> Any:
        return interrupt(await original(*args))

    monkeypatch.setattr(module, name,
                        interrupted_async if inspect.iscoroutinefunction(original) else interrupted)


def test_an_interrupt_as_a_thread_or_task_gets_its_place_gives_it_back(
        engine, dsn, namespace, monkeypatch) -> None:
    """Capped at 1: a thread's, then a task's, acquisition interrupted right after its
    place under the cap was taken, before it connected: the place is free again."""
    locks = capped(engine, dsn, namespace, 1)
    interrupt_as_it_returns(monkeypatch, _capacity, "reserve")
    with pytest.raises(KeyboardInterrupt):
        locks.acquire("a")
    assert locks._capacity.open == 0
    assert locks.acquire("b", timeout=0)
    locks.release("b")
    locks.close()
    assert locks._capacity.open == 0

    interrupt_as_it_returns(monkeypatch, _tasks, "reserve_async", Interrupt)

    async def main() -> None:
        with pytest.raises(Interrupt):
            await locks.aio.acquire("a")
        assert locks._capacity.open == 0
        assert await locks.aio.acquire("b", timeout=0)
        await locks.aio.release("b")

    locks = capped(engine, dsn, namespace, 1)
    try:
        run(main)
    finally:
        locks.close()
    assert locks._capacity.open == 0


@pytest.mark.parametrize("by", ["thread", "task"])
def test_an_interrupt_as_a_thread_or_task_queues_for_a_place_leaves_the_queue(
        engine, dsn, namespace, workers, by) -> None:
    """Capped at 1, held by another thread: an acquisition interrupted right after it
    joined the queue leaves it, and the place given back later goes to nobody but the
    next caller."""
    locks = capped(engine, dsn, namespace, 1)
    holder = workers("holder")
    holder.run(lambda: locks.acquire("a"))

    async def main() -> None:
        with pytest.raises(Interrupt):
            await locks.aio.acquire("b")

    try:
        with pytest.MonkeyPatch.context() as patch:
            interrupt_as_it_returns(patch, _capacity, "claim",
                                    KeyboardInterrupt if by == "thread" else Interrupt,
                                    lambda taken: taken is False)
            if by == "thread":
                with pytest.raises(KeyboardInterrupt):
                    locks.acquire("b")
            else:
                run(main)
        assert not locks._capacity.waiters
    finally:
        holder.run(lambda: locks.release("a"))
    assert locks.acquire("b", timeout=0)  # the place is there for the taking
    locks.release("b")
    locks.close()
    assert locks._capacity.open == 0


@pytest.mark.parametrize("then", ["acquire", "close"])
def test_a_place_given_to_a_task_whose_loop_then_closed_comes_back(
        engine, dsn, namespace, then) -> None:
    """Capped at 1, held by a thread: a task waits in line; its loop stops (as a shutdown
    cut short by another Ctrl-C leaves it), the thread gives its connection back (its place
    goes to the task), then the loop is closed. Nobody takes that place there: the next
    acquisition (which sweeps closed loops) or ``close()`` gives it back."""
    locks = capped(engine, dsn, namespace, 1)
    capacity = locks._capacity
    assert locks.acquire("held")
    loop = asyncio.new_event_loop()

    async def queued() -> asyncio.Task[bool]:
        waiting = asyncio.create_task(locks.aio.acquire("t"))
        await until(lambda: len(capacity.waiters) == 1, "the task waits for the connection")
        return waiting

    try:
        stranded = loop.run_until_complete(asyncio.wait_for(queued(), PATIENCE))
        locks.release("held")  # its place goes to the task, which its stopped loop never runs
        assert not capacity.waiters and capacity.open == 1
    finally:
        loop.close()
    with pytest.warns(AbandonedLockWarning):  # the sweep ends the task, which held "t"
        if then == "acquire":
            assert locks.acquire("x", timeout=0)
            locks.release("x")
        locks.close()
    assert capacity.open == 0 and not stranded.done()
    del stranded
    assert quietly_collect() == []
