"""``PgLockManager.aio`` and ``PgRWLockManager.aio`` against a real server: asyncio tasks as
owners, beside the process's threads and other processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import signal
import threading
import time
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

import pgserver  # noqa: F401  (first: it skips this module where psycopg cannot load libpq)
import psycopg
from conftest import PATIENCE, Delegating, block_records, wait_until
from lockmgr import (AbandonedLockWarning, DeadlockError, LockLost, LockTimeout, NotOwnedError,
                     postgres)
from lockmgr.postgres._aio_link import _AsyncLink
from lockmgr.postgres._session import _Session
from lockmgr.postgres._sql import _GRANTED_ADVISORY
from pg_support import (
    HOLDER, child, expect, finish, held_on_server, own_sessions_locks, quietly_collect, run,
    strand_a_holder, terminate_holder, until, _waiting_on_server,
)

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


@pytest.fixture
def locks(pg_locks: postgres.PgLockManager[Any]) -> postgres.PgLockManager[Any]:
    return pg_locks  # the PostgreSQL manager (pg_fixtures), in place of conftest's ``locks``


@pytest.fixture
def rwlocks(engine, dsn, namespace) -> Iterator[postgres.PgRWLockManager[Any]]:  # noqa: F811
    manager: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    yield manager
    manager.close()


def test_a_task_acquires_reentrantly_and_only_the_owner_releases(locks, dsn) -> None:
    async def main() -> None:
        aio = locks.aio
        assert await aio.acquire("k") is True
        assert await aio.acquire("k", timeout=0) is True
        assert aio.owned("k") and aio.recursion_count("k") == 2
        assert held_on_server(dsn, locks, "k") and await aio.locked("k")

        async def other_task() -> None:
            assert not aio.owned("k")
            with pytest.raises(NotOwnedError,
                               match="key 'k' is not held by the calling task 'other'"):
                await aio.release("k")
            assert await aio.acquire("k", timeout=0) is False

        await asyncio.create_task(other_task(), name="other")
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
        assert len(locks._task_idle) == 1  # it finished its work: the connection is reusable
        assert len(locks) == 0

    run(main)
    finish(holder)


@pytest.mark.parametrize("how", ["wait", "timed", "many"])
def test_a_grant_that_raced_the_cancellation_is_undone(locks, dsn, monkeypatch, how) -> None:
    """The cancellation lands just as the server's answer (the grant) comes in."""
    original = _AsyncLink._round_trip_async

    async def granted_then_cancelled(self: Any, deadline: Any, send: Any, *args: Any) -> Any:
        results = await original(self, deadline, send, *args)
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


@pytest.mark.posix_only
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


@pytest.mark.posix_only
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
    with pytest.raises(TypeError, match="a bare @aio.synchronized over it"):
        @locks.aio.synchronized
        async def bare(account: int) -> None: ...


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
    real_lose_levels = _Session.lose_levels

    def interrupted(session: _Session) -> None:
        monkeypatch.setattr(_Session, "lose_levels", real_lose_levels)
        raise KeyboardInterrupt  # where a signal handler's may land

    async def main() -> None:
        aio = locks.aio
        await aio.acquire("k")
        await aio.acquire("j")
        await asyncio.to_thread(terminate_holder, dsn, locks, "k")
        monkeypatch.setattr(_Session, "lose_levels", interrupted)
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


# -- async with blocks: which task is inside ------------------------------------------------------
#
# ``__aenter__`` records the task that acquired (weakly) and its session; ``__aexit__`` gives
# back that task's hold, in that task. Run by another task while the owner still runs (a
# generator another task closes, asyncio's async-generator finalizer) it cannot use the
# owner's connection: NotOwnedError there, and the owner keeps the key until it releases it
# or ends. Once the owner's session has ended (the task is done, or the sweep ended a task
# stranded on a closed loop), the exit releases nothing and raises nothing. One object holds
# one task at a time: another task entering it while a task is inside is refused
# (RuntimeError), with nothing taken.


def sweep_stranded(locks: postgres.PgLockManager[Any]) -> None:
    """The manager's next call ends the tasks stranded on closed loops (their connections
    closed, their keys released in process with an AbandonedLockWarning)."""
    with pytest.warns(AbandonedLockWarning):
        locks.lost_keys()


def server_holders(dsn: str, manager: Any, key: object) -> int:  # noqa: F811
    """How many server sessions hold ``key`` (a read is held by each reader's session)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {_GRANTED_ADVISORY} %s",
                           (manager.advisory_key(key),)).fetchone()
    return int(row[0]) if row else 0


def loop_errors() -> list[BaseException | None]:
    """What the running loop reports from now on (an async generator's ``aclose()`` task
    that asyncio's finalizer hook started and that raised: "Task exception was never
    retrieved"), collected instead of logged."""
    errors: list[BaseException | None] = []
    asyncio.get_running_loop().set_exception_handler(
        lambda loop, context: errors.append(context.get("exception")))
    return errors


VIEWS: dict[str, Callable[[Any, str], Any]] = {
    "aio[key]": lambda manager, key: manager.aio[key],
    "hold()": lambda manager, key: manager.aio.hold(key),
    "hold_many()": lambda manager, key: manager.aio.hold_many([key]),
    "write()": lambda manager, key: manager.aio.write(key),
    "read()": lambda manager, key: manager.aio.read(key),
    "rw hold_many()": lambda manager, key: manager.aio.hold_many(writes=[key]),
}
RW_VIEWS = {"write()", "read()", "rw hold_many()"}


@pytest.mark.parametrize("style", list(VIEWS))
def test_a_block_gives_back_its_tasks_hold_and_the_task_may_nest_it(locks, rwlocks, dsn,
                                                                     style) -> None:
    """One object entered twice by one task holds two levels; each exit gives one back, the
    last on the server too; the object then keeps no record of the task."""
    manager = rwlocks if style in RW_VIEWS else locks

    async def main() -> None:
        before = block_records()
        view = VIEWS[style](manager, "k")
        async with view:
            async with view:
                assert manager.aio.owned("k") and server_holders(dsn, manager, "k") == 1
            assert manager.aio.owned("k") and server_holders(dsn, manager, "k") == 1
        assert not manager.aio.owned("k") and server_holders(dsn, manager, "k") == 0
        with pytest.raises(RuntimeError, match="not entered"):  # one exit too many
            await view.__aexit__(None, None, None)
        del view
        assert block_records() == before

    run(main)


@pytest.mark.parametrize("style", list(VIEWS))
def test_an_exit_without_an_entry_raises_runtime_error_and_releases_nothing(locks, rwlocks, dsn,
                                                                            style) -> None:
    """``__aexit__`` of an object never entered: RuntimeError, and the key the task holds
    by ``acquire`` stays held, here and on the server."""
    manager = rwlocks if style in RW_VIEWS else locks

    async def main() -> None:
        aio = manager.aio
        acquire = aio.acquire_read if style == "read()" else (
            aio.acquire_write if style in RW_VIEWS else aio.acquire)
        assert await acquire("k", timeout=0)
        with pytest.raises(RuntimeError, match="__aexit__ of an async with object that is not entered"):
            await VIEWS[style](manager, "k").__aexit__(None, None, None)
        assert aio.owned("k") and server_holders(dsn, manager, "k") == 1
        assert await aio.release_all() == 1
        assert server_holders(dsn, manager, "k") == 0

    run(main)


def test_one_stored_aio_key_view_serves_two_tasks_in_turn(locks, dsn) -> None:
    """``view = locks.aio[key]`` shared as one shares an ``asyncio.Lock``: the second task
    waits for the key while the first is inside, and enters once the first's exit released;
    each exit gives back its own task's hold."""
    view = locks.aio["k"]
    seen: list[tuple[str, object, object]] = []

    async def user(name: str, inside: asyncio.Event, leave: asyncio.Event) -> None:
        async with view:
            seen.append((name, locks.aio.recursion_count("k"), server_holders(dsn, locks, "k")))
            inside.set()
            await leave.wait()
        seen.append((name, "left, owns", locks.aio.owned("k")))

    async def main() -> None:
        a_in, a_out, b_in, b_out = (asyncio.Event() for _ in range(4))
        a = asyncio.create_task(user("a", a_in, a_out))
        await a_in.wait()
        b = asyncio.create_task(user("b", b_in, b_out))
        await until(lambda: "waiting=1" in repr(locks._engine), "b waits for the key")
        assert not b_in.is_set()
        a_out.set()
        await b_in.wait()
        b_out.set()
        await asyncio.gather(a, b)
        assert server_holders(dsn, locks, "k") == 0 and len(locks) == 0

    run(main)
    assert seen == [("a", 1, 1), ("a", "left, owns", False),
                    ("b", 1, 1), ("b", "left, owns", False)], seen


def test_two_tasks_sharing_one_read_object_the_second_entry_raises_and_keeps_nothing(
        rwlocks, dsn) -> None:
    """Readers overlap, but one ``read()`` object records one task: a second task entering
    it while the first is inside gives back the read it took and raises RuntimeError; the
    first reads on undisturbed. Once the first has left, the object serves another task."""
    guard = rwlocks.aio.read("config")
    seen: dict[str, object] = {}

    async def first(inside: asyncio.Event, leave: asyncio.Event) -> None:
        async with guard:
            inside.set()
            await leave.wait()
            seen["first still reads"] = rwlocks.aio.owned("config")

    async def second() -> None:
        with pytest.raises(RuntimeError, match="already entered by another task"):
            async with guard:
                raise AssertionError("entered an object another task is inside")
        seen["second holds"] = rwlocks.aio.owned("config")
        seen["readers on the server"] = server_holders(dsn, rwlocks, "config")

    async def third() -> None:
        async with guard:
            seen["third reads"] = (rwlocks.aio.owned("config"),
                                   server_holders(dsn, rwlocks, "config"))

    async def main() -> None:
        inside, leave = asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(first(inside, leave))
        await inside.wait()
        await asyncio.create_task(second())
        leave.set()
        await a
        await asyncio.create_task(third())
        seen["readers at the end"] = server_holders(dsn, rwlocks, "config")

    run(main)
    assert seen == {"second holds": False, "readers on the server": 1, "first still reads": True,
                    "third reads": (True, 1), "readers at the end": 0}, seen


async def _inside(view: Any) -> AsyncIterator[None]:
    async with view:
        yield


async def _entered_elsewhere(how: str, view: Any) -> Callable[[], Awaitable[Any]]:
    """Enter ``view`` in a frame that outlives this call: an async generator suspended in
    its block, or an AsyncExitStack; the closer that exits it."""
    if how == "async generator":
        generator = _inside(view)
        await generator.__anext__()
        return generator.aclose
    stack = contextlib.AsyncExitStack()
    await stack.enter_async_context(view)
    return stack.aclose


@pytest.mark.parametrize("then", ["releases", "ends"])
@pytest.mark.parametrize("how", ["async generator", "AsyncExitStack"])
@pytest.mark.parametrize("style", ["aio[key]", "hold()"])
def test_a_block_another_task_exits_raises_not_owned_there_and_its_task_keeps_the_key(
        locks, dsn, style, how, then) -> None:
    """A task enters blocks on fresh objects through an async generator or an
    AsyncExitStack, and another task closes each while the first runs on: that exit cannot
    use the owner's connection, so it raises NotOwnedError in the closing task and releases
    nothing; the owner holds the key (here and on the server) until it releases it or ends.
    Nothing of those blocks stays with the running task, and nothing is left held."""
    keys = [f"k{index}" for index in range(5)]
    seen: dict[str, object] = {}

    async def owner() -> None:
        for key in keys:
            closer = await _entered_elsewhere(how, VIEWS[style](locks, key))

            async def closes() -> None:
                with pytest.raises(NotOwnedError, match="which still runs"):
                    await closer()

            await asyncio.create_task(closes())
            del closer
            assert locks.aio.recursion_count(key) == 1 and held_on_server(dsn, locks, key)
            assert await asyncio.create_task(locks.aio.acquire(key, timeout=0)) is False
            if then == "releases":
                await locks.aio.release(key)
                assert not held_on_server(dsn, locks, key)

    async def main() -> None:
        before = block_records()
        await asyncio.create_task(owner())
        await until(lambda: not any(held_on_server(dsn, locks, key) for key in keys),
                    "the owner's keys are free on the server")
        seen["held in process"] = len(locks)
        seen["records kept"] = block_records() - before

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(main)
    abandoned = sorted(str(w.message).split("key ")[1].split(";")[0] for w in caught
                       if issubclass(w.category, AbandonedLockWarning))
    assert seen == {"held in process": 0, "records kept": 0}, seen
    assert abandoned == ([] if then == "releases" else [repr(key) for key in keys]), abandoned


def run_in_thread(main: Callable[[], Awaitable[object]], seconds: float) -> list[object]:
    """asyncio.run(main()) in a daemon thread: [result or exception], or [] if still running
    after ``seconds`` (the thread is then left waiting forever)."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(main()))  # type: ignore[arg-type]
        except BaseException as error:  # noqa: BLE001
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    return outcome


def test_an_async_generator_asyncio_finalizes_raises_not_owned_there_and_its_consumer_keeps_its_keys(
        locks, dsn) -> None:  # noqa: F811
    """asyncio finalizes an async generator dropped mid-iteration (``break`` out of ``async
    for``) by running ``aclose()`` in a task of its own: the exit of its ``async with
    locks.aio.hold("g")`` is the consumer's block run by another task. It raises
    NotOwnedError there and touches nothing of the consumer's: "g" and "other" stay held on
    the consumer's connection while it runs inside its own block, "g" until it releases it."""
    seen: dict[str, object] = {}

    async def rows(closed: asyncio.Event) -> AsyncIterator[int]:
        try:
            async with locks.aio.hold("g"):
                yield 1
                yield 2
        finally:
            closed.set()

    async def main() -> None:
        errors = loop_errors()
        closed = asyncio.Event()
        async with locks.aio.hold("other"):
            async for _ in rows(closed):
                break  # dropped: asyncio's finalizer closes it in a task of its own
            await closed.wait()
            await until(lambda: bool(errors), "the finalizer's task reported its error")
            seen["errors"] = [type(error).__name__ for error in errors]
            seen["g"] = (locks.aio.recursion_count("g"), held_on_server(dsn, locks, "g"))
            seen["other"] = held_on_server(dsn, locks, "other")
            await locks.aio.release("g")
            seen["g released"] = not held_on_server(dsn, locks, "g")
        seen["other released"] = not held_on_server(dsn, locks, "other")
        seen["held in process"] = len(locks)

    outcome = run_in_thread(lambda: asyncio.wait_for(main(), PATIENCE * 3), PATIENCE * 4)
    assert outcome == [None], outcome or "the consumer still runs"
    assert seen == {"errors": ["NotOwnedError"], "g": (1, True), "other": True,
                    "g released": True, "other released": True, "held in process": 0}, seen


def test_an_async_generator_asyncio_finalizes_does_not_hang_its_consumers_wait(
        locks, dsn, namespace) -> None:  # noqa: F811
    """The same close, landing while the consumer awaits a round trip on its connection (a
    timed wait for a key another process holds): the finalizer's exit leaves the
    connection alone, and the wait times out on time. The consumer then ends holding "g",
    which its end releases."""
    holder = child(dsn, namespace, HOLDER)
    expect(holder, held=True)
    errors: list[BaseException | None] = []

    async def rows() -> AsyncIterator[int]:
        async with locks.aio.hold("g"):
            yield 1
            yield 2

    async def main() -> object:
        caught = loop_errors()
        async with locks.aio.hold("other"):
            async for _ in rows():
                break
            got = await locks.aio.acquire("k", timeout=1.0)
        await until(lambda: bool(caught), "the finalizer's task reported its error")
        errors.extend(caught)
        return got

    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            outcome = run_in_thread(main, 1.0 + PATIENCE)
            wait_until(lambda: not held_on_server(dsn, locks, "g"), "its end released g")
    finally:
        finish(holder)
    assert outcome == [False], outcome or "the consumer still waits"
    assert [type(error).__name__ for error in errors] == ["NotOwnedError"], errors
    assert any("'g'" in str(w.message) for w in warned
               if issubclass(w.category, AbandonedLockWarning)), [str(w.message) for w in warned]


def test_a_shared_key_lock_a_finalized_generator_left_serves_the_next_task(locks, dsn) -> None:  # noqa: F811
    """A task leaves a shared ``locks.aio["k"]`` through an async generator asyncio
    finalizes while the task runs on (NotOwnedError in the finalizer's task; the task keeps
    "k" and ends holding it: its end releases it). The object is free again: the next
    task's generator on it, closed by ``aclose()`` in that very task, releases "k"."""
    lock = locks.aio["k"]
    seen: dict[str, object] = {}

    async def gen() -> AsyncIterator[None]:
        async with lock:
            yield

    async def first(errors: list[BaseException | None]) -> None:
        async for _ in gen():
            break  # dropped: the finalizer's task runs the exit (and cannot release)
        await until(lambda: bool(errors), "the finalizer's task reported its error")
        seen["first, after the finalizer"] = (locks.aio.recursion_count("k"),
                                              held_on_server(dsn, locks, "k"))

    async def second() -> None:
        agen = gen()
        await agen.__anext__()
        seen["second inside"] = locks.aio.recursion_count("k")
        await agen.aclose()  # its own exit, in this very task
        seen["second, after aclose"] = (locks.aio.recursion_count("k"),
                                        held_on_server(dsn, locks, "k"))

    async def main() -> None:
        errors = loop_errors()
        await asyncio.create_task(first(errors))  # ends holding "k": released at its end
        seen["errors"] = [type(error).__name__ for error in errors]
        await until(lambda: not held_on_server(dsn, locks, "k"), "first's end released k")
        await asyncio.create_task(second())

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        run(main)
    assert seen == {"first, after the finalizer": (1, True), "errors": ["NotOwnedError"],
                    "second inside": 1, "second, after aclose": (0, False)}, seen


@pytest.mark.parametrize("closer", ["the current holder", "another task"])
@pytest.mark.parametrize("style", ["hold()", "shared aio[key]"])
def test_closing_the_block_of_a_task_that_ended_releases_nothing_and_keeps_the_current_holders_key(
        locks, dsn, style, closer) -> None:
    """A task ends inside a block of an async generator kept elsewhere: its end releases
    "g" (AbandonedLockWarning). Another task then holds "g"; closing the ended task's
    block releases nothing and raises nothing, whichever task closes it. A shared object
    the ended task is inside refuses other tasks until that block is closed (RuntimeError,
    nothing taken), and serves them again after."""
    shared = locks.aio["g"]
    kept: dict[str, Any] = {}
    seen: dict[str, object] = {}

    async def rows() -> AsyncIterator[None]:
        async with shared if style == "shared aio[key]" else locks.aio.hold("g"):
            yield

    async def ends_inside() -> None:
        generator = rows()
        await generator.__anext__()
        kept["generator"] = generator

    async def main() -> None:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            kept["task"] = asyncio.create_task(ends_inside())  # (kept: its record's task lives)
            await kept["task"]
            await until(lambda: not held_on_server(dsn, locks, "g") and len(locks) == 0,
                        "its end released g")
        seen["warned"] = [str(w.message).split("holding ")[1] for w in warned
                          if issubclass(w.category, AbandonedLockWarning)]
        if style == "shared aio[key]":
            with pytest.raises(RuntimeError, match="ended inside it"):
                async with shared:
                    raise AssertionError("entered an object an ended task is inside")
            seen["refused entry holds"] = (len(locks), held_on_server(dsn, locks, "g"))
        async with locks.aio.hold("g"):
            if closer == "the current holder":
                await kept["generator"].aclose()
            else:
                await asyncio.create_task(kept["generator"].aclose())
            seen["holder keeps"] = (locks.aio.recursion_count("g"), held_on_server(dsn, locks, "g"))
        async with shared:
            seen["shared serves"] = locks.aio.recursion_count("g")
        seen["released"] = not held_on_server(dsn, locks, "g") and len(locks) == 0

    run(main)
    expected: dict[str, object] = {"warned": ["key 'g'; released it"], "holder keeps": (1, True),
                                   "shared serves": 1, "released": True}
    if style == "shared aio[key]":
        expected["refused entry holds"] = (0, False)
    assert seen == expected, seen


@pytest.mark.parametrize("style", ["hold()", "aio[key]"])
def test_closing_a_stranded_tasks_block_releases_nothing_and_keeps_the_current_holders_key(
        locks, dsn, style) -> None:  # noqa: F811
    """A stranded task (its loop closed in its block, the sweep ended it) is most often
    closed where it spends its time: in the body of its ``async with``. Its exit is an ended
    task's: closed (as the garbage collector's finalization does) while a task of another
    loop holds the same key, it releases nothing, awaits nothing and raises nothing: that
    task keeps the key, in process and on the server, until its own release."""
    stranded = strand_a_holder(locks, "k", None if style == "hold()" else locks.aio["k"])
    sweep_stranded(locks)
    wait_until(lambda: not held_on_server(dsn, locks, "k"), "its session ended")
    outcome: dict[str, object] = {}
    coroutine = stranded.get_coro()  # what the garbage collector's finalization calls: close()

    async def main() -> None:
        aio = locks.aio
        assert await aio.acquire("k", timeout=PATIENCE)
        await aio.release("k")  # (its unlock is prepared on the connection from now on)
        assert await aio.acquire("k", timeout=PATIENCE)
        try:
            coroutine.close()
        except BaseException as error:  # noqa: BLE001
            outcome["close"] = repr(error)
        outcome["owned"] = aio.owned("k")
        outcome["held on the server"] = await asyncio.to_thread(held_on_server, dsn, locks, "k")
        try:  # (a second close, as a later collection would)
            coroutine.close()
        except BaseException as error:  # noqa: BLE001
            outcome["second close"] = repr(error)
        await aio.release("k")
        outcome["released"] = not await asyncio.to_thread(held_on_server, dsn, locks, "k")

    try:
        run(main)
    finally:
        del stranded, coroutine
        outcome["collecting raised"] = quietly_collect()
    assert outcome == {"owned": True, "held on the server": True, "released": True,
                       "collecting raised": []}, outcome


@pytest.mark.parametrize("ending", ["closed", "collected"])
@pytest.mark.parametrize("enters", ["directly", "through a delegating wrapper"])
def test_a_shared_view_a_stranded_task_is_inside_refuses_other_tasks_until_its_block_is_closed(
        locks, dsn, enters, ending) -> None:  # noqa: F811
    """A task held "k" through a shared ``locks.aio["k"]`` (directly, or entered by a user's
    async context manager around it) and was stranded on a closed loop; the sweep ended it.
    Until its coroutine is closed, the object refuses other tasks (RuntimeError, nothing
    taken). A task holding "k" by a block of its own keeps it when the stranded coroutine
    is closed or collected meanwhile: that exit is an ended task's, and releases nothing
    and raises nothing. The object then serves again, and a generator on it closed by its
    own task releases "k"."""
    shared = locks.aio["k"]
    stranded = strand_a_holder(locks, "k", shared if enters == "directly" else Delegating(shared))
    sweep_stranded(locks)
    outcome: dict[str, object] = {}

    async def main() -> None:
        nonlocal stranded
        with pytest.raises(RuntimeError, match="ended inside it"):
            async with shared:
                raise AssertionError("entered an object a stranded task is inside")
        outcome["refused entry holds"] = (locks.aio.recursion_count("k"), len(locks))
        async with locks.aio["k"]:  # a block of its own
            if ending == "closed":
                stranded.get_coro().close()  # what the garbage collector's finalization does
            del stranded
            outcome["collecting raised"] = quietly_collect()
            outcome["holder keeps"] = (locks.aio.recursion_count("k"),
                                       await asyncio.to_thread(held_on_server, dsn, locks, "k"))
        generator = _inside(shared)
        await generator.__anext__()
        outcome["shared serves"] = locks.aio.recursion_count("k")
        await generator.aclose()  # its own exit, in this very task
        outcome["after aclose"] = (locks.aio.recursion_count("k"),
                                   await asyncio.to_thread(held_on_server, dsn, locks, "k"))

    try:
        run(main)
    finally:
        if "collecting raised" not in outcome:
            del stranded
            quietly_collect()
    assert outcome == {"refused entry holds": (0, 0), "collecting raised": [],
                       "holder keeps": (1, True), "shared serves": 1,
                       "after aclose": (0, False)}, outcome


@pytest.mark.parametrize("style", ["aio[key]", "hold()"])
def test_a_shared_view_keeps_no_stranded_task_once_swept(locks, style) -> None:  # noqa: F811
    """A task inside a block of a long-lived object (one ``aio[key]`` view, one
    ``hold()``), stranded on a closed loop while it sleeps, and swept (its connection
    closed, ended in process): the object must not keep it, and serves again once the
    stranded coroutine is collected."""
    shared = VIEWS[style](locks, "k")
    stranded = strand_a_holder(locks, "k", shared)
    sweep_stranded(locks)
    alive = weakref.ref(stranded)
    del stranded
    assert quietly_collect() == []
    assert alive() is None, "the shared object keeps the stranded task alive"

    async def main() -> None:
        async with shared:
            assert await locks.aio.locked("k")

    run(main)
    assert not locks.locked("k")


@pytest.mark.parametrize("enters", ["AsyncExitStack", "a delegating wrapper"])
@pytest.mark.parametrize("style", ["aio[key]", "hold()"])
def test_a_long_lived_view_entered_indirectly_keeps_nothing_of_its_blocks(locks, dsn, style,
                                                                          enters) -> None:  # noqa: F811
    """A long-lived ``locks.aio["k"]`` (or ``hold("k")``) entered block after block through
    an AsyncExitStack or a user's wrapper keeps nothing of the blocks that exited: no
    frame, no stack, no task, no record beyond its own."""
    shared = VIEWS[style](locks, "k")
    refs: list[weakref.ref[Any]] = []

    async def block() -> None:
        if enters == "AsyncExitStack":
            async with contextlib.AsyncExitStack() as stack:
                refs.append(weakref.ref(stack))
                await stack.enter_async_context(shared)
                assert locks.aio.recursion_count("k") == 1
        else:
            wrapper = Delegating(shared)
            refs.append(weakref.ref(wrapper))
            async with wrapper:
                assert locks.aio.recursion_count("k") == 1

    async def main() -> None:
        before = block_records()
        for _ in range(20):
            task = asyncio.create_task(block())
            refs.append(weakref.ref(task))
            await task
            del task
        assert block_records() == before
        assert not await locks.aio.locked("k")

    run(main)
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0


def test_closing_the_block_of_a_task_just_awaited_to_its_end_raises_nothing(locks, dsn) -> None:  # noqa: F811
    """The rule's "the owner is done" includes a task its awaiter resumes after: ``await
    task`` resumes the awaiter from the task's first done callback, before the ones that
    end its session. Closing the finished task's block there must release nothing and
    raise nothing (its end releases "g"), as it does a moment later."""
    kept: dict[str, Any] = {}

    async def rows() -> AsyncIterator[None]:
        async with locks.aio.hold("g"):
            yield

    async def ends_inside() -> None:
        generator = rows()
        await generator.__anext__()
        kept["generator"] = generator

    async def main() -> None:
        task = asyncio.create_task(ends_inside())
        await task
        assert task.done()
        try:
            await kept["generator"].aclose()
        finally:
            await until(lambda: not held_on_server(dsn, locks, "g") and len(locks) == 0,
                        "its end released g")

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        run(main)


@contextlib.contextmanager
def no_cyclic_collector() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def backend_alive(dsn: str, pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s)",
                           (pid,)).fetchone()
    return bool(row and row[0])


def test_a_manager_dropped_after_its_tasks_ended_closes_their_connections_at_once(
        engine, dsn, namespace) -> None:  # type: ignore[no-untyped-def]
    """No cycle keeps it: it is freed by its last reference, without the cyclic collector,
    and its tasks' idle connections close with it."""
    with no_cyclic_collector():
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)

        async def main() -> None:
            assert await locks.aio.acquire("k")
            async with locks.aio.hold("j"):
                pass
            await locks.aio.release("k")

        run(main)
        backends = [link.backend for link in locks._task_idle]
        assert backends  # the tasks' connection, idle now
        freed = weakref.ref(locks)
        del locks
        assert freed() is None
        wait_until(lambda: not any(backend_alive(dsn, pid) for pid in backends),
                   "its connections are closed")


def test_a_manager_lives_while_a_task_holds_its_keys(engine, dsn, namespace) -> None:  # type: ignore[no-untyped-def]
    """The other side: a task inside a block keeps the manager, whoever else dropped it."""
    with no_cyclic_collector():
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
        freed = weakref.ref(locks)
        blocks = [locks.aio.hold("k")]
        del locks
        holding, release = asyncio.Event(), asyncio.Event()

        async def holder(block: Any) -> None:
            async with block:
                holding.set()
                await release.wait()

        async def main() -> None:
            task = asyncio.create_task(holder(blocks.pop()))
            await holding.wait()
            assert freed() is not None and held_on_server(dsn, freed(), "k")
            release.set()
            await task

        run(main)
        assert freed() is None  # the task and its block are gone: so is the manager


# -- a release is done at the call, awaited or not --------------------------------------------


def _releases(locks: postgres.PgLockManager[Any], rw: postgres.PgRWLockManager[Any]
              ) -> list[tuple[Callable[[], Awaitable[bool]], Callable[[], Awaitable[None]]]]:
    """(acquire "k", release it) in each form of the two views."""
    return [(lambda: locks.aio.acquire("k"), lambda: locks.aio.release("k")),
            (lambda: locks.aio["k"].acquire(), lambda: locks.aio["k"].release()),
            (lambda: locks.aio.acquire_many(["k"]), lambda: locks.aio.release_many(["k"])),
            (lambda: rw.aio.acquire_read("k"), lambda: rw.aio.release_read("k")),
            (lambda: rw.aio.acquire_write("k"), lambda: rw.aio.release_write("k")),
            (lambda: rw.aio.acquire_many(writes=["k"]), lambda: rw.aio.release_many(writes=["k"]))]


@pytest.mark.parametrize("which", range(6))
def test_a_release_nobody_awaits_still_releases_on_the_server(locks, rwlocks, dsn,
                                                              which) -> None:
    """Code moved from the in-process ``aio`` (``aio.release(key)``, no await): the key is
    released in process at the call, and on the server within a round trip, with no
    warning; the task's next acquisition waits for that release, then takes the key anew."""
    acquire, release = _releases(locks, rwlocks)[which]
    manager = locks if which < 3 else rwlocks

    async def main() -> None:
        assert await acquire()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            release()  # not awaited
            gc.collect()
        assert len(manager) == 0
        await until(lambda: not held_on_server(dsn, manager, "k"), "released on the server")
        assert await acquire()  # taken again, on the server too
        release()
        assert await acquire()  # at once after an unawaited release: after it, anew
        assert held_on_server(dsn, manager, "k") and len(manager) == 1
        await release()  # awaited: released on the server when it returns
        assert not held_on_server(dsn, manager, "k") and len(manager) == 0

    run(main)


def test_a_release_raises_not_owned_and_lock_lost_at_the_call(locks, dsn) -> None:
    """NotOwnedError at the call, nothing changed; a key whose connection the call finds
    dead is LockLost at the call (one the server's release finds gone, when awaited), the
    key no longer held either way."""
    async def main() -> None:
        with pytest.raises(NotOwnedError):
            locks.aio.release("k")  # not awaited: raised at the call
        assert await locks.aio.acquire("k")
        terminate_holder(dsn, locks, "k")
        with pytest.raises(LockLost):
            locks.aio.release("k")
        assert len(locks) == 0
        assert await locks.aio.acquire("k", timeout=PATIENCE)
        await locks.aio.release("k")

    run(main)


@pytest.mark.parametrize("which", range(6))
def test_an_acquisition_never_awaited_warns_when_collected(locks, rwlocks, which) -> None:
    """As in process, on both engines: an ``aio`` acquisition made and never awaited
    warns as a coroutine does, and takes nothing."""
    acquiring = _releases(locks, rwlocks)[which][0]()
    with pytest.warns(RuntimeWarning, match=r"^coroutine '[\w.]+' was never awaited$"):
        del acquiring
        gc.collect()
    assert len(locks) == len(rwlocks) == 0


def test_a_release_whose_round_trip_fails_is_lock_lost_when_awaited(locks, dsn,
                                                                    monkeypatch) -> None:
    """The server's release fails (the connection breaks on the way): the connection is
    closed, so nothing stays held, and awaiting the release's answer raises LockLost."""
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise psycopg.OperationalError("the connection broke")

    async def main() -> None:
        assert await locks.aio.acquire("k")
        monkeypatch.setattr(_AsyncLink, "_round_trip_async", broken)
        answer = locks.aio.release("k")
        assert len(locks) == 0
        with pytest.raises(LockLost, match="'k'"):
            await answer
        monkeypatch.undo()
        assert not held_on_server(dsn, locks, "k")
        assert await locks.aio.acquire("k", timeout=0)
        await locks.aio.release("k")

    run(main)
