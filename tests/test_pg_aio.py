"""``PgLockManager.aio`` and ``PgRWLockManager.aio`` against a real server: asyncio tasks as
owners, beside the process's threads and other processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

import psycopg
from conftest import PATIENCE
from lockmgr import DeadlockError, LockLost, LockTimeout, NotOwnedError, postgres
from lockmgr._pg_aio import _AsyncLink
from test_postgres import (  # noqa: F401  (fixtures: pytest finds them by name here)
    _waiting_on_server,
    children_reaped,
    child,
    dsn,
    engine,
    expect,
    finish,
    held_on_server,
    namespace,
    nothing_left_held,
    own_sessions_locks,
    terminate_holder,
)


@pytest.fixture
def locks(engine, dsn, namespace) -> Iterator[postgres.PgLockManager[Any]]:  # noqa: F811
    manager: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    yield manager
    manager.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition`` (a real state) holds."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.002)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))


HOLDER = """
locks.acquire("k")
say(held=True)
sys.stdin.readline()
locks.release("k")
"""


def test_a_task_acquires_reentrantly_and_only_the_owner_releases(locks, dsn) -> None:
    async def main() -> None:
        aio = locks.aio
        assert await aio.acquire("k") is True
        assert await aio.acquire("k", timeout=0) is True
        assert aio.owned("k") and aio.recursion_count("k") == 2
        assert held_on_server(dsn, locks, "k") and await aio.locked("k")

        async def other_task() -> None:
            assert not aio.owned("k")
            with pytest.raises(NotOwnedError):
                await aio.release("k")
            assert await aio.acquire("k", timeout=0) is False

        await asyncio.create_task(other_task())
        await aio.release("k")
        assert held_on_server(dsn, locks, "k")  # one level left
        await aio.release("k")
        assert not held_on_server(dsn, locks, "k") and not aio.owned("k")
        with pytest.raises(NotOwnedError):
            await aio.release("k")
        with pytest.raises(TypeError):
            await aio.acquire(["not", "a", "key"])
        async with aio.hold("k") as held:
            assert held and held.keys == ("k",) and aio.owned("k")
        async with aio["k"]:
            assert aio.recursion_count("k") == 1
        assert len(locks) == 0

    run(main)
    with pytest.raises(RuntimeError, match="asyncio task"):
        locks.aio.owned("k")


def test_a_task_and_a_thread_of_one_process_never_both_hold_a_key(locks, dsn) -> None:
    another_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)  # one thread: the
    # release below runs on the thread that acquired (asyncio.to_thread may pick another)

    async def in_another_thread(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            another_thread, functools.partial(call, *args, **kwargs))

    async def main() -> None:
        locks.acquire("k")  # this thread; the task below runs on it, but owns by task
        assert await locks.aio.acquire("k", timeout=0.05) is False
        locks.release("k")
        assert await locks.aio.acquire("k", timeout=0) is True
        # The thread is refused while the task holds it, in-process already.
        assert await in_another_thread(locks.acquire, "k", timeout=0) is False
        await locks.aio.release("k")
        assert await in_another_thread(locks.acquire, "k", timeout=0) is True
        await in_another_thread(locks.release_all)

    try:
        run(main)
    finally:
        another_thread.shutdown()
    assert not held_on_server(dsn, locks, "k")


def test_tasks_wait_for_another_process_and_time_out_leaving_nothing(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, """
    locks.acquire_many(["k", "b"])
    say(held=True)
    sys.stdin.readline()
    """)
    expect(holder, held=True)

    async def main() -> None:
        aio = locks.aio
        assert await aio.acquire("k", timeout=0) is False
        started = time.monotonic()
        assert await aio.acquire("k", timeout=0.2) is False
        assert time.monotonic() - started >= 0.2
        assert await aio.acquire_many(["a", "b"], timeout=0.2) is False  # all or nothing
        assert not held_on_server(dsn, locks, "a") and len(locks) == 0
        with pytest.raises(LockTimeout):
            async with aio.hold("k", timeout=0.05):
                pytest.fail("entered without the key")
        async def take_turn() -> bool:
            got = await aio.acquire("k")
            assert aio.owned("k") and held_on_server(dsn, locks, "k")
            await aio.release("k")
            return got

        waiter = asyncio.create_task(take_turn())
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits on the server")
        assert not waiter.done()
        finish(holder)  # the other process releases: the task gets the key
        assert await waiter is True

    run(main)


def test_cancelling_a_task_cancels_its_server_side_wait(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)

    async def main() -> None:
        waiter = asyncio.create_task(locks.aio.acquire_many(["a", "k"]))
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits on the server")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # The clean-up ran before the cancellation reached the caller: nothing waits on
        # the server, and "a", granted before the wait for "k", is given back.
        assert _waiting_on_server(dsn) == 0
        assert own_sessions_locks(dsn) == 0 and len(locks) == 0
        finish(holder)
        assert await locks.aio.acquire_many(["a", "k"], timeout=PATIENCE) is True
        await locks.aio.release_many(["a", "k"])

    run(main)


def test_a_second_cancellation_never_stops_the_clean_up(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)

    async def main() -> None:
        async def take_both() -> None:
            await locks.aio.acquire_many(["a", "k"])

        waiter = asyncio.create_task(take_both())
        await until(lambda: _waiting_on_server(dsn) == 1, "the task waits on the server")
        (session,) = locks._tasks.sessions.values()
        waiter.cancel()
        await until(lambda: session.cleaning is not None, "the clean-up started")
        waiter.cancel()  # while the task waits for its clean-up
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await until(lambda: session.cleaning is None, "the clean-up ended all the same")
        assert _waiting_on_server(dsn) == 0 and own_sessions_locks(dsn) == 0
        assert len(locks._tasks.idle) == 1  # it finished its work: the connection is reusable
        assert len(locks) == 0

    run(main)
    finish(holder)


@pytest.mark.parametrize("how", ["wait", "timed", "many"])
def test_a_grant_that_raced_the_cancellation_is_undone(locks, dsn, monkeypatch, how) -> None:
    """The cancellation lands just as the server's answer (the grant) comes in."""
    original = _AsyncLink._round_trip_async

    async def granted_then_cancelled(self: Any, send: Any, *args: Any) -> Any:
        results = await original(self, send, *args)
        locking = send.__name__ != "send_prepare" and (
            b"pg_advisory_lock" in args[0] or args[0].startswith(b"lockmgr_pg_advisory_lock"))
        if locking:
            raise asyncio.CancelledError
        return results

    monkeypatch.setattr(_AsyncLink, "_round_trip_async", granted_then_cancelled)

    async def main() -> None:
        aio = locks.aio
        with pytest.raises(asyncio.CancelledError):
            if how == "wait":
                await aio.acquire("k")
            elif how == "timed":
                await aio.acquire("k", timeout=PATIENCE)
            else:
                await aio.acquire_many(["k", "other"])
        assert not aio.owned("k") and len(locks) == 0
        assert not held_on_server(dsn, locks, "k") and not held_on_server(dsn, locks, "other")

    run(main)


def test_ctrl_c_under_asyncio_run_leaves_nothing_held_or_waiting(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    waiter = child(dsn, namespace, """
    import asyncio
    async def main():
        await locks.aio.acquire("mine")
        say(waiting=True)
        await locks.aio.acquire("k")
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        say(interrupted=True)  # asyncio.run has returned; the process lives on
    sys.stdin.readline()
    """)
    expect(waiter, waiting=True)
    deadline = time.monotonic() + PATIENCE
    while _waiting_on_server(dsn) != 1:
        assert time.monotonic() < deadline, "the child never waited on the server"
        time.sleep(0.002)
    waiter.send_signal(signal.SIGINT)
    expect(waiter, interrupted=True)
    # The interrupted process still runs: its "mine" and its wait for "k" are gone.
    assert _waiting_on_server(dsn) == 0
    assert not held_on_server(dsn, locks, "mine")
    finish(waiter)
    finish(holder)


def test_a_killed_holder_frees_its_keys_for_a_task(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, """
    import asyncio
    async def main():
        await locks.aio.acquire("k")
        say(held=True)
        await asyncio.to_thread(sys.stdin.readline)
    asyncio.run(main())
    """)
    expect(holder, held=True)

    async def main() -> None:
        assert await locks.aio.acquire("k", timeout=0) is False
        holder.send_signal(signal.SIGKILL)
        assert await locks.aio.acquire("k", timeout=PATIENCE) is True
        await locks.aio.release("k")

    run(main)
    holder.communicate(timeout=PATIENCE)


def test_a_terminated_connection_is_a_lost_lock_for_a_task(engine, dsn, namespace) -> None:
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=lost.append)

    async def main() -> None:
        aio = locks.aio
        await aio.acquire("k")
        await aio.acquire("k")
        await asyncio.to_thread(terminate_holder, dsn, locks, "k")

        async def other_task_looks() -> set[object]:
            return await aio.lost_keys()

        while "k" not in await asyncio.create_task(other_task_looks()):
            await asyncio.sleep(0.002)  # bounded by run()'s timeout
        assert lost == [["k"]] and "k" in await aio.lost_keys()
        assert not aio.owned("k")
        for _ in range(2):  # each level's release says so
            with pytest.raises(LockLost):
                await aio.release("k")
        assert lost == [["k"]]
        with pytest.raises(NotOwnedError):
            await aio.release("k")
        assert not aio.owned("k") and len(locks) == 0 and await aio.lost_keys() == set()
        assert await aio.acquire("k", timeout=1) is True  # a new session takes it again
        await aio.release("k")

    run(main)
    locks.close()


def test_a_task_that_ends_holding_a_key_frees_it_on_the_server(locks, dsn, recwarn) -> None:
    async def main() -> None:
        async def forgetful() -> None:
            await locks.aio.acquire("k")

        await asyncio.create_task(forgetful())
        await until(lambda: not held_on_server(dsn, locks, "k"), "its session ended")
        assert len(locks) == 0
        assert await locks.aio.acquire("k", timeout=0) is True
        await locks.aio.release("k")

    run(main)
    assert any("k" in str(warning.message) for warning in recwarn)


def test_a_deadlock_between_a_task_and_another_process_is_reported(locks, dsn, namespace) -> None:
    other = child(dsn, namespace, """
    locks.acquire("A")
    say(holding="A")
    try:
        got = locks.acquire("B", timeout=30)
        say(deadlock=False, got=got)
        locks.release("B")
    except DeadlockError:
        say(deadlock=True)
    locks.release("A")
    sys.stdin.readline()
    """)

    async def main() -> None:
        aio = locks.aio
        await aio.acquire("B")
        expect(other, holding="A")
        await until(lambda: _waiting_on_server(dsn) >= 1, "the other process waits for B")
        try:
            ours, deadlocked_here = await aio.acquire("A", timeout=30), False
        except DeadlockError:
            ours, deadlocked_here = False, True
        if ours:
            await aio.release("A")
        await aio.release("B")
        theirs = await asyncio.to_thread(expect, other)
        assert deadlocked_here != theirs["deadlock"], theirs
        assert len(locks) == 0

    run(main)
    finish(other)


def test_rw_tasks_share_reads_and_exclude_writes(engine, dsn, namespace) -> None:
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    writer = child(dsn, namespace, """
    sys.stdin.readline()
    say(wrote=locks.acquire_write("k", timeout=0))
    sys.stdin.readline()
    """, cls="PgRWLockManager")

    async def main() -> None:
        done = asyncio.Event()

        async def reader() -> None:
            async with rw.aio.read("k"):
                assert rw.aio.owned("k") and rw.aio.recursion_count("k") == 0
                await done.wait()

        tasks = [asyncio.create_task(reader()) for _ in range(2)]
        await until(lambda: rw.readers("k") == 2, "both tasks read")
        assert await rw.aio.write_locked("k") is False
        assert writer.stdin is not None
        writer.stdin.write("try\n")
        writer.stdin.flush()
        said = await asyncio.to_thread(expect, writer)
        assert said["wrote"] is False  # another process cannot write while they read
        done.set()
        await asyncio.gather(*tasks)
        assert await rw.aio.acquire_many(reads=["r"], writes=["w"]) is True
        assert await rw.aio.write_locked("w") and rw.aio.owned("r")
        await rw.aio.release_many(reads=["r"], writes=["w"])
        async with rw.aio.write("k", timeout=PATIENCE):
            assert rw.aio.recursion_count("k") == 1

    run(main)
    finish(writer)
    rw.close()


def test_synchronized_coroutines_take_turns_across_tasks(locks) -> None:
    inside: list[int] = []

    @locks.aio.synchronized(lambda account: f"account:{account}")
    async def touch(account: int) -> None:
        inside.append(account)
        assert len(inside) == 1
        await asyncio.sleep(0)
        inside.pop()

    async def main() -> None:
        await asyncio.gather(*(touch(7) for _ in range(8)))

    run(main)
    with pytest.raises(TypeError, match="coroutine"):
        locks.aio.synchronized(lambda: "k")(lambda: None)


def test_release_all_gives_back_every_level(locks, dsn) -> None:
    async def main() -> None:
        aio = locks.aio
        await aio.acquire("a")
        await aio.acquire("a")
        await aio.acquire_many(["b", "c"])
        assert await aio.release_all() == 3  # keys, every level of each
        assert len(locks) == 0 and own_sessions_locks(dsn) == 0

    run(main)


def test_no_lost_update_between_tasks_threads_and_processes(engine, dsn, namespace) -> None:
    """Two processes, each with three tasks and a thread, read-modify-write one counter
    under one key (a cancelled task among them)."""
    table = f"counter_{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (n int)")
        conn.execute(f"INSERT INTO {table} VALUES (0)")
    body = f"""
    import asyncio, psycopg
    ROUNDS = 15
    def bump(conn):
        n = conn.execute("SELECT n FROM {table}").fetchone()[0]
        conn.execute("UPDATE {table} SET n = %s", (n + 1,))
    def thread_worker():
        with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
            for _ in range(ROUNDS):
                with locks.hold("counter"):
                    bump(conn)
    async def task_worker():
        conn = await psycopg.AsyncConnection.connect(os.environ["DSN"], autocommit=True)
        async with conn:
            for _ in range(ROUNDS):
                async with locks.aio.hold("counter"):
                    n = (await (await conn.execute("SELECT n FROM {table}")).fetchone())[0]
                    await asyncio.sleep(0)
                    await conn.execute("UPDATE {table} SET n = %s", (n + 1,))
    async def cancelled():
        while True:
            async with locks.aio.hold("counter"):
                await asyncio.sleep(0)
    async def main():
        thread = threading.Thread(target=thread_worker)
        thread.start()
        doomed = asyncio.create_task(cancelled())
        await asyncio.gather(*(task_worker() for _ in range(3)))
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        await asyncio.to_thread(thread.join)
    asyncio.run(main())
    say(done=True)
    """
    pure = engine.__name__ == "lockmgr._pure"  # the children run the engine under test
    processes = [child(dsn, namespace, body, pure=pure) for _ in range(2)]
    for process in processes:
        expect(process, done=True)
        finish(process)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(f"SELECT n FROM {table}").fetchone()[0] == 2 * 4 * 15


@pytest.mark.parametrize("then", ["release", "release_all"])
def test_an_interrupt_halfway_through_losing_a_connection_loses_its_keys_all_the_same(
        locks, dsn, monkeypatch, then) -> None:  # noqa: F811
    """As for threads (test_postgres): an exception raised by a signal handler after the
    dead connection was taken from the task's session but before its keys were moved to
    ``lost``: the task's next call finishes the loss."""
    real_lose_levels = postgres._Session.lose_levels

    def interrupted(session: postgres._Session) -> None:
        monkeypatch.setattr(postgres._Session, "lose_levels", real_lose_levels)
        raise KeyboardInterrupt  # where a signal handler's may land

    async def main() -> None:
        aio = locks.aio
        await aio.acquire("k")
        await aio.acquire("j")
        await asyncio.to_thread(terminate_holder, dsn, locks, "k")
        monkeypatch.setattr(postgres._Session, "lose_levels", interrupted)
        with pytest.raises(KeyboardInterrupt):
            await aio.release("k")  # finds the connection dead
        assert not aio.owned("k") and not aio.owned("j")  # j: its connection is gone
        with pytest.raises(LockLost, match="'j'"):
            if then == "release":
                await aio.release("j")
            else:
                await aio.release_all()
        assert len(locks) == 0 and await aio.lost_keys() == set()
        assert not await asyncio.to_thread(held_on_server, dsn, locks, "j")
        assert await aio.acquire("j", timeout=PATIENCE)  # a new connection takes it again
        await aio.release("j")

    run(main)
