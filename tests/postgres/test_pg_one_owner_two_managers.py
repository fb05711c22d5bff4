"""One thread or task, two PostgreSQL managers of one server and database: a key it holds
through one and asks the other for would wait on the server for its own session, for ever.
Refused at once with DeadlockError, timed or not, nothing changed; a try, which never
waits, finds the key taken."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from conftest import PATIENCE
from lockmgr import DeadlockError

import psycopg
from lockmgr import postgres
from pg_support import child, expect, finish, held_on_server, run, until, _waiting_on_server

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")

TIMEOUTS = (0.2, -1)  # timed, untimed (last: before the fix it waits for ever)


@pytest.fixture
def pair(engine, dsn, namespace) -> Iterator[tuple[postgres.PgLockManager[Any],  # type: ignore[no-untyped-def]
                                                   postgres.PgRWLockManager[Any]]]:
    """A PgLockManager and a PgRWLockManager of one namespace, the second through another
    DSN string (same server and database)."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(
        dsn, namespace=namespace, connect_kwargs={"application_name": "another"})
    yield locks, rw
    for manager in (locks, rw):
        manager.release_all()
        manager.close()


def test_a_thread_asking_another_manager_for_a_key_it_holds_is_refused_at_once(pair, dsn) -> None:
    locks, rw = pair
    assert locks.acquire("k")
    for timeout in TIMEOUTS:
        for take in (rw.acquire_write, rw.acquire_read):
            with pytest.raises(DeadlockError, match="holds 'k' through another manager") as error:
                take("k", timeout=timeout)
            assert error.value.cycle == [(threading.get_ident(), "k")]
        with pytest.raises(DeadlockError):
            rw.acquire_many(reads=["j"], writes=["k"], timeout=timeout)
        with pytest.raises(DeadlockError):
            with rw.write("k", timeout=None if timeout < 0 else timeout):
                pass
    assert rw.acquire_write("k", timeout=0) is False  # a try: taken, by the other manager
    # Nothing changed: the refused manager holds nothing, the other still holds its key.
    assert len(rw) == 0 and "k" not in rw and "j" not in rw
    assert locks.owned("k") and held_on_server(dsn, locks, "k")
    assert not held_on_server(dsn, locks, "j")
    locks.release("k")
    assert rw.acquire_write("k", timeout=0)  # released there: taken here
    with pytest.raises(DeadlockError, match="holds 'k' through another manager"):
        locks.acquire("k")  # and the other way round
    rw.release_write("k")


def test_reads_through_two_managers_share_a_key(engine, dsn, namespace) -> None:
    """Shared beside shared is no conflict: both are taken; a write beside a read is
    refused."""
    first: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    second: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    assert first.acquire_read("k")
    assert second.acquire_read("k", timeout=0)
    with pytest.raises(DeadlockError):
        second.acquire_write("k", timeout=0.2)
    second.release_read("k")
    first.release_read("k")
    first.close()
    second.close()


def test_another_thread_or_namespace_or_database_waits_as_usual(pair, engine, dsn,
                                                                 workers) -> None:
    """Only the caller's own locks, on the same server and database, are refused: another
    thread's is waited for, another namespace's key is another lock, and another database's
    advisory locks are its own."""
    locks, rw = pair
    other = workers("other")
    other.run(lambda: locks.acquire("k"))
    assert rw.acquire_write("k", timeout=0.1) is False  # another thread's: waited for
    other.run(lambda: locks.release("k"))
    elsewhere: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace="other")
    database = f"lockmgr_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    there: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(
        psycopg.conninfo.make_conninfo(dsn, dbname=database), namespace=rw._namespace)
    try:
        assert elsewhere.acquire("k")
        assert there.acquire_write("k", timeout=0)
        assert rw.acquire_write("k", timeout=0)  # neither is this one's lock
        rw.release_write("k")
        there.release_write("k")
        elsewhere.release("k")
    finally:
        there.close()
        elsewhere.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {database}")


def test_a_task_asking_another_manager_for_a_key_it_holds_is_refused_at_once(pair, dsn) -> None:
    """The same for a task; another task is not refused: it waits for the first one's
    release. The task's loop thread, called from it, would wait for the task, which
    cannot run: refused too."""
    locks, rw = pair

    async def another_task_takes_it() -> None:
        assert await rw.aio.acquire_write("k", timeout=PATIENCE)
        await rw.aio.release_write("k")

    async def main() -> None:
        assert await locks.aio.acquire("k")
        for timeout in TIMEOUTS:
            with pytest.raises(DeadlockError, match="calling task holds 'k'"):
                await rw.aio.acquire_read("k", timeout=timeout)
            with pytest.raises(DeadlockError, match="calling task holds 'k'"):
                async with rw.aio.write("k", timeout=None if timeout < 0 else timeout):
                    pass
            with pytest.raises(DeadlockError, match="calling task holds 'k'"):
                rw.acquire_write("k", timeout=timeout)  # the loop's thread
        assert await rw.aio.acquire_write("k", timeout=0) is False  # a try: taken
        assert len(rw) == 0
        other = asyncio.create_task(another_task_takes_it())
        await until(lambda: _waiting_on_server(dsn) == 1, "the other task waits")
        await locks.aio.release("k")
        await other

    run(main)
    assert not held_on_server(dsn, rw, "k")


def test_the_loop_thread_asking_another_manager_for_a_key_another_of_its_tasks_holds_is_refused(
        pair, dsn) -> None:
    """A task holds ``k`` through one manager; another task of the same loop makes a
    blocking call to the other manager for ``k``: the holder cannot run while the loop's
    thread waits, so the call is refused at once, as the in-process engine refuses it
    through one manager."""
    locks, rw = pair
    holding, done = asyncio.Event(), asyncio.Event()

    async def holder() -> None:
        assert await locks.aio.acquire("k")
        holding.set()
        await done.wait()
        await locks.aio.release("k")

    async def main() -> None:
        held = asyncio.create_task(holder())
        await holding.wait()
        for timeout in TIMEOUTS:
            with pytest.raises(DeadlockError, match="holds 'k' through another manager"):
                rw.acquire_write("k", timeout=timeout)  # the loop's thread, in another task
        assert len(rw) == 0
        done.set()
        await held

    run(main)
    assert not held_on_server(dsn, rw, "k") and not held_on_server(dsn, locks, "k")


def test_the_check_for_a_key_held_elsewhere_waits_for_a_connection_no_longer_than_the_call(
        engine, dsn, namespace) -> None:
    """The check needs a connection of the asked manager to learn its server: at its
    ``max_connections``, a timed call waits for one until its deadline only, then times
    out holding nothing (a thread's and a task's alike), while another thread keeps that
    manager's connection."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    capped: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                 max_connections=1)
    holding, done = threading.Event(), threading.Event()

    def keep_the_only_connection() -> None:
        assert capped.acquire("busy")
        holding.set()
        done.wait(PATIENCE)  # (before the fix the timed calls below wait this long)
        capped.release("busy")

    keeper = threading.Thread(target=keep_the_only_connection)
    keeper.start()
    try:
        assert holding.wait(PATIENCE)
        assert locks.acquire("k")
        assert capped.acquire("k", timeout=0.2) is False
        assert not done.is_set()  # timed out while the connection was still kept

        async def main() -> None:
            assert await locks.aio.acquire("t")
            assert await capped.aio.acquire("t", timeout=0.2) is False
            assert not done.is_set()
            await locks.aio.release("t")

        run(main)
        assert len(capped) == 1  # "busy" only
        locks.release("k")
    finally:
        done.set()
        keeper.join(PATIENCE)
        locks.close()
        capped.close()
    assert not keeper.is_alive()


@pytest.mark.posix_only
def test_a_forked_child_holds_none_of_its_parents_keys_through_another_manager(
        engine, dsn, namespace) -> None:
    """The parent's key is not the child's: the child's other manager waits for it as for
    another process's, and is not refused."""
    parent = child(dsn, namespace, """
    rw = postgres.PgRWLockManager(os.environ["DSN"], namespace=os.environ["NAMESPACE"])
    locks.acquire("k")
    pid = os.fork()
    if pid == 0:
        try:
            code = 0 if rw.acquire_write("k", timeout=0.2) is False else 2
        except DeadlockError:
            code = 3
        sys.exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    say(child=code)
    locks.release("k")
    """, pure=engine.__name__.endswith("_pure"))
    expect(parent, child=0)
    finish(parent)
