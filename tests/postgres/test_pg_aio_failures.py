"""The PostgreSQL asyncio views when things fail: clean-ups after a cancellation, keys
lost while a clean-up runs, a fork from a task, a pooled connection that dies while it
waits, a loop closed with a task waiting on the server, Ctrl-C in asyncio.run's shutdown.
Against a real server; each test states what must hold."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest

import pgserver  # noqa: F401  (first: it skips this module where psycopg cannot load libpq)
import psycopg

from conftest import PATIENCE, wait_until
from lockmgr import AbandonedLockWarning, LockLost, postgres
from pg_support import (
    HOLDER, child, expect, finish, held_on_server, run, slow_abort, terminate_holder, until,
    _waiting_on_server,
)

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


@pytest.fixture
def locks(pg_locks: postgres.PgLockManager[Any]) -> postgres.PgLockManager[Any]:
    return pg_locks  # the PostgreSQL manager (pg_fixtures), in place of conftest's ``locks``


def test_a_release_answered_after_a_clean_up_that_kept_its_connection_is_no_loss(
        locks, dsn, namespace, monkeypatch) -> None:  # noqa: F811
    """A cancelled wait starts a clean-up, and a second cancellation stops the task waiting
    for it; the task then releases a key it held: the release waits for the clean-up, which
    releases everything and keeps the connection (handed back idle). Awaited, the release
    raises nothing: the key was released on the server, not lost."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    slow_abort(monkeypatch, 0.3)

    async def main() -> None:
        aio = locks.aio
        assert await aio.acquire("a")
        me = asyncio.current_task()
        assert me is not None
        session = locks._tasks.sessions[me]

        async def cancel_twice() -> None:
            await until(lambda: _waiting_on_server(dsn) == 1, "the task waits for k")
            me.cancel()  # 1: the wait is cancelled, the clean-up starts
            await until(lambda: session.cleaning is not None, "the clean-up started")
            me.cancel()  # 2: the task stops waiting for it

        canceller = asyncio.create_task(cancel_twice())
        with pytest.raises(asyncio.CancelledError):
            await aio.acquire("k")
        me.uncancel()
        me.uncancel()
        await canceller
        assert session.cleaning is not None  # still under way: the release waits for it
        await aio.release("a")  # raised LockLost: the clean-up's link change taken for a loss
        assert locks.lost_keys() == set() and not held_on_server(dsn, locks, "a")

    run(main)
    finish(holder)


def test_release_all_cancelled_during_a_clean_up_leaves_a_server_lock_on_an_idle_link(
        locks, dsn, namespace, monkeypatch) -> None:  # noqa: F811
    """release_all() waiting for a clean-up and cancelled there clears the levels without
    unlocking: the clean-up then hands the connection, still holding "a" on the server,
    to the idle pool; another task reusing it holds "a" twice, and other processes never
    get "a" again."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    slow_abort(monkeypatch, 0.3)

    async def main() -> None:
        aio = locks.aio
        in_release_all = asyncio.Event()

        async def worker() -> None:
            await aio.acquire("a")
            try:
                await aio.acquire("k")  # waits: the child holds "k"
            finally:
                in_release_all.set()
                await aio.release_all()

        task = asyncio.create_task(worker())
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits for k")
        (session,) = locks._tasks.sessions.values()
        task.cancel()  # 1: the wait is cancelled, the clean-up starts
        await until(lambda: session.cleaning is not None, "the clean-up started")
        task.cancel()  # 2: the task stops waiting for it, goes to its finally
        await until(in_release_all.is_set, "the task is in release_all")
        await asyncio.sleep(0.05)  # it waits there for the clean-up
        assert session.cleaning is not None
        task.cancel()  # 3
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: session.cleaning is None, "the clean-up ended")
        assert len(locks) == 0 and not aio.owned("a")
        # What should hold: the task holds nothing, so nothing is held on the server.
        leaked = held_on_server(dsn, locks, "a")
        idle = len(locks._task_idle)

        async def next_user() -> bool:  # takes the pooled connection, and "a", and gives back
            await aio.acquire("a")
            await aio.release("a")
            return held_on_server(dsn, locks, "a")

        still = await asyncio.create_task(next_user())
        locks.close()  # (ends the leaked session, for the fixtures)
        assert not leaked, (f"'a' still held on the server by a pooled connection "
                            f"(idle={idle}); after another task took and released it: {still}")

    run(main)
    finish(holder)


def test_a_cancelled_release_does_not_release_while_a_clean_up_runs(
        locks, dsn, namespace, monkeypatch) -> None:  # noqa: F811
    """"A cancelled release still releases" (module docstring): also when the release's
    answer waits for an earlier clean-up and is cancelled there. The release was done at
    the call: "a" is released in process at once, and on the server by that clean-up,
    which the task's next call (here ``lost_keys``) waits for."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    slow_abort(monkeypatch, 0.3)

    async def main() -> None:
        aio = locks.aio
        releasing = asyncio.Event()
        carried_on = asyncio.Event()
        after: dict[str, Any] = {}

        async def worker() -> None:
            try:
                async with aio.hold("a"):
                    try:
                        await aio.acquire("k")
                    finally:
                        releasing.set()
            except asyncio.CancelledError:
                pass  # a worker that survives cancellations (e.g. a supervisor's retry)
            after["owned"] = aio.owned("a")
            assert await aio.lost_keys() == set()  # (waits for the clean-up)
            after["server"] = await asyncio.to_thread(held_on_server, dsn, locks, "a")
            carried_on.set()
            await aio.release_all()

        task = asyncio.create_task(worker())
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits for k")
        (session,) = locks._tasks.sessions.values()
        task.cancel()
        await until(lambda: session.cleaning is not None, "the clean-up started")
        task.cancel()
        await until(releasing.is_set, "the task left the acquire")
        await asyncio.sleep(0.05)
        task.cancel()  # lands in release("a"), waiting for the clean-up
        await task
        assert carried_on.is_set()
        assert after == {"owned": False, "server": False}, after

    run(main)
    finish(holder)


def test_lost_keys_from_another_task_during_a_clean_up_loses_the_cleaners_keys(
        engine, dsn, namespace) -> None:  # noqa: F811
    """A task holding "a" is cancelled waiting for "k" (and goes on); a monitoring task
    calls lost_keys() while the clean-up runs: the cancelled statement (or its clean-up,
    which talks on the connection without ``talking`` set) makes the connection look
    dead, so "a" is reported to on_lost and then really lost, though nothing failed."""
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=lost.append)
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)

    async def main() -> None:
        aio = locks.aio
        outcome: dict[str, Any] = {}

        async def worker() -> None:
            await aio.acquire("a")
            try:
                await aio.acquire("k")
            except asyncio.CancelledError:
                pass  # as asyncio.timeout() turns it into a TimeoutError (3.11+)
            await aio.acquire("b")  # any call that settles the session
            await aio.release("b")
            try:
                await aio.release("a")
                outcome["release"] = "ok"
            except LockLost as error:
                outcome["release"] = repr(error)

        task = asyncio.create_task(worker())
        await until(lambda: bool(locks._tasks.sessions), "the worker has a session")
        (session,) = locks._tasks.sessions.values()
        await until(lambda: _waiting_on_server(dsn) == 1, "the worker waits for k")
        task.cancel()
        await until(lambda: session.cleaning is not None, "the worker's clean-up started")
        seen = await aio.lost_keys()  # a health check, from another task
        await task
        assert (seen, lost, outcome["release"]) == (set(), [], "ok")

    try:
        run(main)
    finally:
        finish(holder)
        locks.close()


def test_owned_after_the_loss_was_found_agrees_with_threads(engine, dsn, namespace) -> None:  # noqa: F811
    """Another owner's lost_keys() found the connection dead (on_lost called with "k"):
    a thread's owned("k") is then False; a task's aio.owned("k") still says True."""
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=lost.append)
    # Threads: the reference behaviour.
    held = threading.Event()
    looked = threading.Event()
    thread_owned: list[bool] = []

    def holder_thread() -> None:
        locks.acquire("t")
        held.set()
        looked.wait(PATIENCE)
        thread_owned.append(locks.owned("t"))
        with pytest.raises(LockLost):
            locks.release("t")

    thread = threading.Thread(target=holder_thread)
    thread.start()
    held.wait(PATIENCE)
    terminate_holder(dsn, locks, "t")
    deadline = time.monotonic() + PATIENCE
    while "t" not in locks.lost_keys():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    looked.set()
    thread.join(PATIENCE)
    assert thread_owned == [False]

    async def main() -> None:
        aio = locks.aio
        taken = asyncio.Event()
        go = asyncio.Event()
        seen: dict[str, object] = {}

        async def holder_task() -> None:
            await aio.acquire("k")
            taken.set()
            await go.wait()
            seen["owned"] = aio.owned("k")
            seen["count"] = aio.recursion_count("k")
            with pytest.raises(LockLost):
                await aio.release("k")

        task = asyncio.create_task(holder_task())
        await taken.wait()
        await asyncio.to_thread(terminate_holder, dsn, locks, "k")
        while "k" not in await aio.lost_keys():
            await asyncio.sleep(0.01)
        assert ["k"] in lost
        go.set()
        await task
        assert seen == {"owned": False, "count": 0}, seen

    try:
        run(main)
    finally:
        locks.close()


@pytest.mark.posix_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
# CPython 3.12+ warns when fork() is called with other threads alive (whatever earlier tests in
# this worker left running, asyncio's to_thread workers): this test forks from the test process
# on purpose, and its child only starts a fresh thread and a fresh loop.
@pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded, use of fork\\(\\) may lead to deadlocks:DeprecationWarning")
def test_fork_from_a_task_holding_a_key(locks, dsn) -> None:  # noqa: F811
    """A child forked by a task holding "k": the parent's session lives on, the child gets
    a session of its own, and "k" (the parent's) is not the child's."""
    async def main() -> None:
        aio = locks.aio
        await aio.acquire("k")
        await aio.acquire("idle-link")
        await aio.release("idle-link")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a fresh loop in a fresh thread
            code = 1
            try:
                result: list[object] = []

                def child_main() -> None:
                    async def inner() -> None:
                        result.append(await locks.aio.acquire("k", timeout=0))
                        result.append(locks.aio.owned("k"))
                        result.append(await locks.aio.acquire("other", timeout=1))
                        await locks.aio.release("other")
                    asyncio.run(inner())

                worker = threading.Thread(target=child_main)
                worker.start()
                worker.join(PATIENCE)
                os.write(write, repr(result).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        said = os.read(read, 1000).decode()
        os.close(read)
        assert status == 0 and said == "[False, False, True]", said
        assert held_on_server(dsn, locks, "k") and aio.owned("k")
        await aio.release("k")
        assert not held_on_server(dsn, locks, "k")

    run(main)


def _terminate_waiter(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        pids = [row[0] for row in admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")]
        assert len(pids) == 1, pids
        admin.execute("SELECT pg_terminate_backend(%s, %s)", (pids[0], int(PATIENCE * 1000)))


def test_a_waiting_pooled_connection_that_dies_is_replaced_as_for_threads(
        engine, dsn, namespace) -> None:  # noqa: F811
    """A thread waiting on a connection it took from the idle list, whose session is then
    ended (pg_terminate_backend), goes on waiting on a new connection (_lock: "a connection
    that had been idle is replaced once"). A task gets psycopg.OperationalError instead:
    _Tasks.lock always treats the link from attach() as fresh."""
    holder = child(dsn, namespace, """
    for line in sys.stdin:
        if line.strip() == "take":
            locks.acquire("w")
        else:
            locks.release("w")
        say(done=line.strip())
    """)

    def tell(what: str) -> None:
        assert holder.stdin is not None
        holder.stdin.write(what + "\n")
        holder.stdin.flush()
        expect(holder, done=what)

    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    tell("take")
    outcome: dict[str, object] = {}
    try:
        # Threads: the reference behaviour.
        locks.acquire("idle")
        locks.release("idle")  # a connection in the idle list

        def thread_waiter() -> None:
            try:
                outcome["thread"] = locks.acquire("w", timeout=PATIENCE)
                locks.release("w")
            except Exception as error:  # noqa: BLE001
                outcome["thread"] = repr(error)

        waiter = threading.Thread(target=thread_waiter)
        waiter.start()
        deadline = time.monotonic() + PATIENCE
        while _waiting_on_server(dsn) != 1:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        _terminate_waiter(dsn)
        time.sleep(0.3)
        tell("give")
        waiter.join(PATIENCE)
        tell("take")

        async def main() -> None:
            aio = locks.aio
            await aio.acquire("idle")
            await aio.release("idle")  # a connection in the tasks' idle list

            async def task_waiter() -> None:
                try:
                    outcome["task"] = await aio.acquire("w", timeout=PATIENCE)
                    await aio.release("w")
                except Exception as error:  # noqa: BLE001
                    outcome["task"] = repr(error)

            task = asyncio.create_task(task_waiter())
            await until(lambda: _waiting_on_server(dsn) == 1, "the task waits")
            await asyncio.to_thread(_terminate_waiter, dsn)
            await asyncio.sleep(0.3)
            await asyncio.to_thread(tell, "give")
            await task

        run(main)
    finally:
        locks.close()
    assert outcome == {"thread": True, "task": True}, outcome


def test_a_threads_lost_keys_checks_the_tasks_connections_too(engine, dsn, namespace) -> None:  # noqa: F811
    """PgLockManager.lost_keys() "checks first, without waiting, the connection of every
    thread holding keys"; a task's connection that died is never checked from a thread
    (a monitoring thread sees nothing until some task looks), where another task's
    aio.lost_keys() does check the threads' connections."""
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=lost.append)

    async def main() -> None:
        aio = locks.aio
        await aio.acquire("k")
        await asyncio.to_thread(terminate_holder, dsn, locks, "k")
        await asyncio.sleep(0.5)  # the session's end has long reached the socket
        seen_by_a_thread = await asyncio.to_thread(locks.lost_keys)
        with pytest.raises(LockLost):
            await aio.release("k")
        assert seen_by_a_thread == {"k"} and lost == [["k"]], (seen_by_a_thread, lost)

    try:
        run(main)
    finally:
        locks.close()


def test_a_loop_closed_with_a_task_waiting_on_the_server_leaves_a_zombie_session(
        locks, dsn, namespace) -> None:  # noqa: F811
    """asyncio.run's shutdown interrupted (a second Ctrl-C on 3.10, a third on 3.11+, while
    _cancel_all_tasks runs) closes the loop with tasks still pending: here a task waiting
    for "k" on the server. Nothing ever closes its connection (the session keeps the Task):
    its statement stays queued in PostgreSQL, which grants it "k" when the holder releases,
    and from then on no process can take "k" while this process lives."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    loop = asyncio.new_event_loop()

    async def wait_for_k() -> None:
        await locks.aio.acquire("mine")
        await locks.aio.acquire("k")

    async def until_waiting() -> asyncio.Task[None]:
        task = asyncio.create_task(wait_for_k())
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits on the server")
        return task

    task = loop.run_until_complete(until_waiting())
    loop.close()  # what asyncio.run's finally does when its shutdown is interrupted
    with pytest.warns(AbandonedLockWarning):  # the task is ended in process too
        locks.lost_keys()  # the next call on the manager, from any thread, closes its connection
    finish(holder)  # the other process releases "k"
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not held_on_server(dsn, locks, "k"):
        time.sleep(0.05)
    zombie = held_on_server(dsn, locks, "k"), held_on_server(dsn, locks, "mine")
    for session in locks._tasks.sessions.values():  # (for the fixtures)
        if session.link is not None:
            session.link.close()
    del task
    assert zombie == (False, False), "('k', 'mine') held on the server by a closed loop's task"


INTERRUPTED = """
import asyncio
from lockmgr.postgres._aio_link import _AsyncLink
original = _AsyncLink.abort
async def slow_abort(self):  # a clean-up over a slow network
    await asyncio.sleep(1.0)
    await original(self)
_AsyncLink.abort = slow_abort
async def main():
    await locks.aio.acquire("mine")
    say(waiting=True)
    await locks.aio.acquire("k")
try:
    asyncio.run(main())
except KeyboardInterrupt:
    pass
while True:  # every Ctrl-C the test sends has landed: asyncio.run has returned
    try:
        sys.stdin.readline()
        break
    except KeyboardInterrupt:
        pass
locks.lost_keys()  # the process's next call on the manager
say(interrupted=True)
sys.stdin.readline()
"""


@pytest.mark.posix_only
def test_ctrl_c_during_asyncio_runs_shutdown_leaves_nothing_held_after_the_next_call(
        locks, dsn, namespace) -> None:  # noqa: F811
    """Ctrl-C again while asyncio.run's shutdown cancels the tasks (a second one on 3.10, a
    third on 3.11+, each landing in the one-second clean-up): asyncio.run returns with the
    loop closed and a task's connection still holding "mine" and queued for "k". The
    process's next call on the manager closes that connection."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    process = child(dsn, namespace, INTERRUPTED)
    expect(process, waiting=True)
    deadline = time.monotonic() + PATIENCE
    while _waiting_on_server(dsn) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    for _ in range(3):
        process.send_signal(signal.SIGINT)
        time.sleep(0.3)  # lands while the (1 s) clean-up runs: bounded either way
    assert process.stdin is not None
    process.stdin.write("\n")
    process.stdin.flush()
    expect(process, interrupted=True)
    # (the server ends a closed session's backend a moment after the client closed it)
    wait_until(lambda: not held_on_server(dsn, locks, "mine") and _waiting_on_server(dsn) == 0,
               "the interrupted process's connection is closed")
    assert process.poll() is None  # by the process, which lives on
    finish(holder)
    finish(process)


def test_on_lost_raising_in_a_clean_up_nobody_awaits_is_never_retrieved(
        engine, dsn, namespace, monkeypatch) -> None:  # noqa: F811
    """The owner was cancelled twice (it no longer waits for its clean-up); the clean-up
    finds the connection dead, loses the session, and on_lost raises: the clean-up task
    ends with that exception, which nobody ever retrieves (settle() never sees the task:
    drop_or_lose cleared session.cleaning), so asyncio reports "Task exception was never
    retrieved" to the loop's exception handler. (Threads: the exception reaches the caller.)"""
    def on_lost(keys: list[object]) -> None:
        raise RuntimeError(f"on_lost failed for {keys}")

    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=on_lost)
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    slow_abort(monkeypatch, 0.3)
    reported: list[str] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: reported.append(context["message"]))
        aio = locks.aio

        async def worker() -> None:
            await aio.acquire("a")
            await aio.acquire("k")

        task = asyncio.create_task(worker())
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits for k")
        (session,) = locks._tasks.sessions.values()
        task.cancel()
        await until(lambda: session.cleaning is not None, "the clean-up started")
        cleaning = session.cleaning
        await asyncio.to_thread(terminate_holder, dsn, locks, "a")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: cleaning.done(), "the clean-up ended")
        del cleaning, session
        import gc
        gc.collect()
        await asyncio.sleep(0)

    try:
        run(main)
    finally:
        finish(holder)
        locks.close()
    # (the in-process engine's AbandonedLockWarning, an error under filterwarnings, aside)
    assert "Task exception was never retrieved" not in reported, reported
