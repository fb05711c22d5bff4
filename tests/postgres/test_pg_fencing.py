"""Fencing tokens of the PostgreSQL managers, against a real server (a server of this module's
own: one test restarts it), in-process and across processes.

Each test's managers put the fence table in a schema of the test's own (``fence_table``; their
search_path starts there too), so each test starts with no table and its first fenced
acquisition makes it."""

from __future__ import annotations

import asyncio
import contextlib
import textwrap
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pgserver
from conftest import PATIENCE, wait_until
from lockmgr import LockError, LockLost, LockTimeout, NotOwnedError

import psycopg
from lockmgr import postgres
from lockmgr.postgres._link import _Link
from pg_support import (
    child, expect, finish, held_on_server, own_sessions_locks, race_timeouts_against_a_holder,
    terminate_holder, _waiting_on_server,
)

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


Manager = postgres.PgLockManager[Any]


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    name = f"fence_{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE SCHEMA {name}")
    yield name
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA {name} CASCADE")


def in_schema(schema: str) -> dict[str, str]:
    return {"options": f"-c search_path={schema}"}


@pytest.fixture
def make_fenced(engine, dsn, namespace, schema) -> Iterator[Callable[..., Manager]]:  # type: ignore[no-untyped-def]
    """Fencing managers of the test's namespace and schema, closed at the end."""
    made: list[Any] = []

    def make(cls: type = postgres.PgLockManager, **kwargs: Any) -> Any:
        manager = cls(dsn, namespace=namespace, fencing=True, fence_table=f"{schema}.lockmgr_fences",
                      connect_kwargs=kwargs.pop("connect_kwargs", in_schema(schema)), **kwargs)
        made.append(manager)
        return manager

    yield make
    for manager in made:
        try:
            manager.release_all()
        except LockLost:
            pass
        manager.close()


@pytest.fixture
def fenced(make_fenced: Callable[..., Manager]) -> Manager:
    return make_fenced()


def storage(dsn: str, schema: str) -> psycopg.Connection[Any]:
    return psycopg.connect(dsn, autocommit=True, options=f"-c search_path={schema}")


def fenced_child(dsn: str, namespace: str, schema: str, body: str,
                 pure: bool = False) -> Any:
    """A child process whose ``fenced`` is a fencing manager of the test's schema."""
    make = (f"fenced = postgres.PgLockManager(os.environ['DSN'], namespace=os.environ['NAMESPACE'],"
            f" fencing=True, fence_table={schema + '.lockmgr_fences'!r},"
            f" connect_kwargs={in_schema(schema)!r})\n")
    return child(dsn, namespace, make + textwrap.dedent(body), pure=pure)


def tell(process: Any, line: str) -> None:
    process.stdin.write(line + "\n")
    process.stdin.flush()


# -- one process -------------------------------------------------------------------------------


def test_fences_increase_and_reentry_keeps_its_fence(fenced: Manager) -> None:
    with fenced.hold("k") as lease:
        first = lease.fence
        assert lease and lease.keys == ("k",) and lease.fences == {"k": first}
        assert repr(lease) == f"<Lease 'k' fence={first}>" and fenced.fence("k") == first
        with fenced.hold("k") as inner:  # reentrant: no new fence
            assert inner.fence == first
        assert fenced.acquire("k", timeout=0) and fenced.fence("k") == first
        fenced.release("k")
        with pytest.raises(AttributeError):
            lease.fence = 0  # type: ignore[misc]
    assert first == 1  # the test's own table: its first fence
    with fenced.hold("k") as lease:  # the prepared wait
        assert lease.fence == first + 1
    assert fenced.acquire("k", timeout=0)  # the prepared try
    assert fenced.fence("k") == first + 2
    fenced.release("k")
    assert fenced.acquire("k", timeout=PATIENCE)  # the timed message
    assert fenced.fence("k") == first + 3
    fenced.release("k")
    with fenced["k"]:  # the key as an RLock: acquire(), then fence()
        assert fenced.fence("k") == first + 4


def test_many_keys_take_a_fence_each(fenced: Manager) -> None:
    with fenced.hold_many(["a", "b"]) as lease:
        assert lease.fences == {"a": 1, "b": 1} and lease.keys == ("a", "b")
        with pytest.raises(LockError, match="lease.fences"):
            lease.fence
        with fenced.hold_many(["a", "c"]) as partly:  # a is held already: its fence stays
            assert partly.fences == {"a": 1, "c": 1}
        assert repr(lease) == "<Lease 'a' fence=1, 'b' fence=1>"
    for timeout, fence in ((0, 2), (PATIENCE, 3)):  # the try and the timed messages
        assert fenced.acquire_many(["a", "b", "c"], timeout=timeout)
        assert [fenced.fence(key) for key in "abc"] == [fence, fence, fence]
        fenced.release_many(["a", "b", "c"])


def test_one_round_trip_per_first_acquire_and_last_release(
        fenced: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Callable[[], bool]] = [
        lambda: fenced.acquire("k"), lambda: fenced.acquire("k", timeout=0),
        lambda: fenced.acquire("k", timeout=PATIENCE), lambda: fenced.acquire_many(["a", "b"]),
        lambda: fenced.acquire_many(["a", "b"], timeout=0),
        lambda: fenced.acquire_many(["a", "b"], timeout=PATIENCE)]
    for call in calls:  # the table made, the statements prepared
        assert call()
        fenced.release_all()
    round_trip = _Link._round_trip
    counted: list[object] = []

    def counting(link: Any, *args: Any) -> Any:
        counted.append(args[0])
        return round_trip(link, *args)

    monkeypatch.setattr(_Link, "_round_trip", counting)
    for call in calls:
        counted.clear()
        assert call()
        assert len(counted) == 1
        fenced.release_all()
        assert len(counted) == 2


def test_a_refused_try_and_a_timed_out_wait_take_no_fence(
        fenced: Manager, make_fenced: Callable[..., Manager], dsn: str, workers) -> None:  # type: ignore[no-untyped-def]
    holder = make_fenced()
    holding = workers("holder")  # (the caller's own lock through another manager is refused)
    holding.run(lambda: holder.acquire("k"))
    try:
        held_fence = holding.run(lambda: holder.fence("k"))
        assert fenced.acquire("k", timeout=0) is False
        assert fenced.acquire_many(["j", "k"], timeout=0) is False
        assert fenced.acquire("k", timeout=0.1) is False
        assert fenced.acquire_many(["j", "k"], timeout=0.1) is False
        with pytest.raises(LockTimeout):
            with fenced.hold("k", timeout=0.05):
                pytest.fail("entered without the key")
        assert len(fenced) == 0 and not held_on_server(dsn, fenced, "j")
    finally:
        holding.run(lambda: holder.release("k"))
    with fenced.hold_many(["j", "k"]) as lease:
        assert lease.fences == {"j": 1, "k": held_fence + 1}  # no fence went missing


def test_timeouts_racing_grants_skip_no_fence(fenced: Manager,
                                              make_fenced: Callable[..., Manager]) -> None:
    """Whatever the race between a timeout and a grant, a call that says False took no
    fence: the fences handed out are 1, 2, 3... with no gap, each side's in order."""
    other = make_fenced()
    theirs: list[int] = []
    ours: list[int] = []

    def attempt(number: int, timeout: float) -> bool:
        keys = ["k", "j"] if number % 2 else ["k"]
        got = fenced.acquire_many(keys, timeout=timeout)
        if got:
            ours.append(fenced.fence("k"))
            fenced.release_many(keys)
        return got

    race_timeouts_against_a_holder(lambda: other.hold("k", timeout=PATIENCE), attempt,
                                   while_held=lambda lease: theirs.append(lease.fence))
    assert ours == sorted(ours) and theirs == sorted(theirs)
    assert sorted(ours + theirs) == list(range(1, len(ours) + len(theirs) + 1))


def test_reads_take_no_fence(make_fenced: Callable[..., Any]) -> None:
    rw: postgres.PgRWLockManager[Any] = make_fenced(postgres.PgRWLockManager)
    with rw.read("k") as lease:
        assert lease and repr(lease) == "<Lease 'k' (read)>" and lease.fences == {}
        with pytest.raises(LockError, match="reading"):
            lease.fence
        with pytest.raises(LockError, match="reading"):
            rw.fence("k")
        with rw.write("k") as upgraded:  # a write while reading takes a fence
            assert upgraded.fence == 1 == rw.fence("k")
    with rw.hold_many(reads=["r"], writes=["k"], timeout=0) as lease:
        assert lease.fences == {"k": 2}
        with pytest.raises(LockError, match="reading"):
            rw.fence("r")
    with rw.write("k", timeout=PATIENCE) as lease:
        assert lease.fence == 3


def test_fence_errors(fenced: Manager, dsn: str, namespace: str) -> None:
    with pytest.raises(NotOwnedError):
        fenced.fence("k")
    with pytest.raises(TypeError):
        fenced.fence(1.5)
    plain: Manager = postgres.PgLockManager(dsn, namespace=namespace)
    try:
        with plain.hold("k") as lease:
            assert lease and repr(lease) == "<Lease 'k'>"
            for asking in (lambda: lease.fence, lambda: lease.fences, lambda: plain.fence("k")):
                with pytest.raises(LockError, match="fencing=True"):
                    asking()
    finally:
        plain.close()
    fenced.acquire("k")
    fenced.acquire("k")
    terminate_holder(dsn, fenced, "k")
    with pytest.raises(LockLost):
        fenced.fence("k")
    with pytest.raises(LockLost):
        fenced.release("k")
    with pytest.raises(LockLost):
        fenced.fence("k")  # until the last level is released
    with pytest.raises(LockLost):
        fenced.release("k")
    with pytest.raises(NotOwnedError):
        fenced.fence("k")
    with fenced.hold("k") as lease:
        assert lease.fence == 2


# -- what fences are for -----------------------------------------------------------------------


def store_balance(conn: psycopg.Connection[Any], account: int, balance: int, fence: int) -> bool:
    """README's example: the write goes through only if no write with a later fence did."""
    cursor = conn.execute(
        "UPDATE accounts SET balance = %s, fence = %s WHERE id = %s AND fence < %s",
        (balance, fence, account, fence))
    return cursor.rowcount == 1


@contextlib.contextmanager
def accounts(dsn: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """README's storage: a table of accounts, each row with the fence of its last write."""
    with storage(dsn, schema) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL,"
                     " fence bigint NOT NULL DEFAULT 0)")
        conn.execute("INSERT INTO accounts (id, balance) VALUES (1, 0)")
        yield conn


def test_a_holder_that_lost_its_lock_cannot_overwrite_the_next_one(
        make_fenced: Callable[..., Manager], dsn: str, schema: str) -> None:
    paused, next_holder = make_fenced(), make_fenced()
    with accounts(dsn, schema) as conn:
        with pytest.raises(LockLost):
            with paused.hold("account:1") as stale:
                # Its session dies while it is paused (a long GC pause, SIGSTOP, a network
                # partition): PostgreSQL frees the key...
                terminate_holder(dsn, paused, "account:1")
                with next_holder.hold("account:1", timeout=PATIENCE) as lease:
                    assert lease.fence == stale.fence + 1
                    assert store_balance(conn, 1, 200, lease.fence)
                # ... and the paused holder wakes up and writes: refused.
                assert not store_balance(conn, 1, 100, stale.fence)
        assert conn.execute("SELECT balance, fence FROM accounts").fetchone() == (200, 2)


# -- across processes and restarts -------------------------------------------------------------


def test_fences_follow_the_holding_order_across_processes(fenced: Manager, engine, dsn: str,  # type: ignore[no-untyped-def]
                                                          namespace: str, schema: str) -> None:
    handed = fenced_child(dsn, namespace, schema, """
    while sys.stdin.readline().strip() == "take":
        with fenced.hold("k") as lease:
            say(fence=lease.fence)
    """, pure=engine.__name__.endswith("_pure"))
    fences = []
    for _ in range(5):  # strictly alternating: the child's fence comes between ours
        with fenced.hold("k") as lease:
            fences.append(lease.fence)
        tell(handed, "take")
        fences.append(expect(handed)["fence"])
    finish(handed)
    assert fences == list(range(1, 11))
    with storage(dsn, schema) as conn:  # and contended: in the order the holds wrote
        conn.execute("CREATE TABLE log (id bigserial PRIMARY KEY, fence bigint NOT NULL)")
    body = """
    import psycopg
    sys.stdin.readline()
    with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
        for _ in range(15):
            with fenced.hold("k") as lease:
                conn.execute("INSERT INTO {schema}.log (fence) VALUES (%s)", (lease.fence,))
    say(done=True)
    """.replace("{schema}", schema)
    racing = [fenced_child(dsn, namespace, schema, body) for _ in range(2)]
    for process in racing:
        tell(process, "go")
    with storage(dsn, schema) as conn:
        for _ in range(15):
            with fenced.hold("k") as lease:
                conn.execute("INSERT INTO log (fence) VALUES (%s)", (lease.fence,))
        for process in racing:
            expect(process, done=True)
            finish(process)
        logged = [row[0] for row in conn.execute("SELECT fence FROM log ORDER BY id")]
    assert logged == list(range(11, 56))


@pytest.mark.parametrize("synchronous_commit", ["on", "off"])
def test_fences_keep_increasing_across_a_server_restart(make_fenced: Callable[..., Manager],
                                                        dsn: str, schema: str,
                                                        synchronous_commit: str) -> None:
    """The increment is committed durably before the fence is handed out, even on a
    session that sets synchronous_commit off (whose commits a crash may lose)."""
    options = {"options": f"-c search_path={schema} -c synchronous_commit={synchronous_commit}"}
    before, after = make_fenced(connect_kwargs=options), make_fenced(connect_kwargs=options)
    with before.hold("warm"):  # the table made, its creation committed
        pass
    before.acquire("k")
    fence = before.fence("k")
    pgserver.restart(dsn)  # immediate: the server stops as in a crash, then recovers
    with pytest.raises(LockLost):
        before.fence("k")
    with after.hold("k", timeout=PATIENCE) as lease:
        assert lease.fence == fence + 1
    with pytest.raises(LockLost):
        before.release("k")
    with before.hold("k") as lease:  # a new session of the same manager
        assert lease.fence == fence + 2


@pytest.mark.posix_only
def test_a_forked_child_has_no_fence_of_its_parents(engine, dsn: str, namespace: str,  # type: ignore[no-untyped-def]
                                                    schema: str) -> None:
    parent = fenced_child(dsn, namespace, schema, """
    fenced.acquire("k")
    pid = os.fork()
    if pid == 0:
        try:
            fenced.fence("k")
            code = 2
        except LockLost:
            code = 0
        sys.exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    say(child=code, fence=fenced.fence("k"))
    fenced.release("k")
    """, pure=engine.__name__.endswith("_pure"))
    expect(parent, child=0, fence=1)
    finish(parent)


# -- the fence table -------------------------------------------------------------------------


def test_the_table_is_made_by_concurrent_first_uses_in_several_processes(  # type: ignore[no-untyped-def]
        engine, dsn: str, namespace: str, schema: str) -> None:
    processes = [fenced_child(dsn, namespace, schema, """
    sys.stdin.readline()
    with fenced.hold("k") as lease:
        say(fence=lease.fence)
    sys.stdin.readline()
    """) for _ in range(4)]
    for process in processes:
        tell(process, "go")
    fences = sorted(expect(process)["fence"] for process in processes)
    for process in processes:
        finish(process)
    assert fences == [1, 2, 3, 4]


def test_the_table_is_made_by_concurrent_first_uses_in_several_threads(fenced: Manager) -> None:
    start = threading.Barrier(4)
    fences: list[int] = []
    failures: list[BaseException] = []

    def first_use() -> None:
        start.wait(PATIENCE)
        try:
            with fenced.hold("k", timeout=PATIENCE) as lease:
                fences.append(lease.fence)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    assert not failures and sorted(fences) == [1, 2, 3, 4]


def test_a_table_made_meanwhile_by_another_session_is_used(
        fenced: Manager, dsn: str, schema: str, workers: Callable[[str], Any]) -> None:
    """Two first uses at once: the second session's CREATE TABLE waits for the first's to
    commit, then fails with a unique violation; the manager uses the table made."""
    with storage(dsn, schema) as other:
        other.autocommit = False
        other.execute("CREATE TABLE lockmgr_fences (key bigint PRIMARY KEY, fence bigint NOT NULL)")
        waiter = workers("first use")
        call = waiter.submit(lambda: fenced.acquire("k"))
        wait_until(lambda: _waiting_for_a_transaction(dsn), "the manager's CREATE waits")
        other.commit()
    assert call.result() is True
    assert waiter.run(lambda: fenced.fence("k")) == 1
    waiter.run(lambda: fenced.release("k"))


def _waiting_for_a_transaction(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid'"
                           " AND NOT granted").fetchone()
    return bool(row and row[0])


CALLS: dict[str, Callable[[Manager], bool]] = {
    "wait": lambda locks: locks.acquire("k"),
    "try": lambda locks: locks.acquire("k", timeout=0),
    "timed": lambda locks: locks.acquire("k", timeout=PATIENCE),
    "many-wait": lambda locks: locks.acquire_many(["k", "j"]),
    "many-try": lambda locks: locks.acquire_many(["k", "j"], timeout=0),
    "many-timed": lambda locks: locks.acquire_many(["k", "j"], timeout=PATIENCE),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_a_fence_that_cannot_be_taken_leaves_nothing_held(make_fenced: Callable[..., Manager],
                                                          dsn: str, schema: str,
                                                          call: str) -> None:
    """Session locks outlive a failed statement: when the fence's increment fails after the
    lock was granted (the table dropped, no privilege on it), the clean-up releases it."""
    acquire = CALLS[call]
    fenced = make_fenced()
    assert acquire(fenced)  # the table made, the statement prepared
    fenced.release_all()
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP TABLE {schema}.lockmgr_fences")
    with pytest.raises(psycopg.errors.UndefinedTable):
        acquire(fenced)
    assert len(fenced) == 0 and not fenced.owned("k") and own_sessions_locks(dsn) == 0

    # A role that may use the schema and not the table (nor create one in the schema).
    role = f"fence_user_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        admin.execute(f"CREATE TABLE {schema}.lockmgr_fences"
                      " (key bigint PRIMARY KEY, fence bigint NOT NULL)")
    try:
        limited = make_fenced(connect_kwargs={**in_schema(schema), "user": role})
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            acquire(limited)
        assert len(limited) == 0 and own_sessions_locks(dsn) == 0
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"GRANT SELECT, INSERT, UPDATE ON {schema}.lockmgr_fences TO {role}")
        assert acquire(limited)
        assert limited.fence("k") == 1
        limited.release_all()
        limited.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


# -- asyncio tasks -----------------------------------------------------------------------------


def run(main: Callable[[], Any]) -> None:
    asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))


def test_tasks_and_threads_take_fences_from_one_counter(fenced: Manager, dsn: str,
                                                        namespace: str, schema: str) -> None:
    async def main() -> None:
        aio = fenced.aio
        async with aio.hold("k") as lease:
            first = lease.fence
            assert aio.fence("k") == first and repr(lease) == f"<Lease 'k' fence={first}>"
            async with aio.hold("k") as inner:  # reentrant: no new fence
                assert inner.fence == first
            # The thread waits in process for the task (the same engine): no fence yet.
            assert await asyncio.to_thread(fenced.acquire, "k", timeout=0) is False
        with fenced.hold("k") as lease:  # a thread of the process takes the next one
            assert lease.fence == first + 1
        assert await aio.acquire_many(["k", "j"], timeout=PATIENCE)  # the timed message
        assert aio.fence("k") == first + 2 and aio.fence("j") == 1
        await aio.release_many(["k", "j"])
        with pytest.raises(NotOwnedError):
            aio.fence("k")
        with pytest.raises(TypeError):
            aio.fence(["no"])

        holder = fenced_child(dsn, namespace, schema, """
        with fenced.hold("k") as lease:
            say(fence=lease.fence)
            sys.stdin.readline()
        """)
        assert (await asyncio.to_thread(expect, holder))["fence"] == first + 3
        assert await aio.acquire("k", timeout=0) is False  # a refused try takes no fence
        assert await aio.acquire("k", timeout=0.05) is False  # nor a timed-out wait
        waiting = asyncio.create_task(aio.acquire("k"))
        while _waiting_on_server(dsn) != 1:
            await asyncio.sleep(0.002)
        waiting.cancel()  # nor a cancelled one
        with pytest.raises(asyncio.CancelledError):
            await waiting
        finish(holder)
        async with aio.hold("k") as lease:
            assert lease.fence == first + 4

    run(main)


def test_a_task_that_lost_its_lock_cannot_overwrite_the_next_holder(
        make_fenced: Callable[..., Manager], dsn: str, schema: str) -> None:
    paused, next_holder = make_fenced(), make_fenced()
    with accounts(dsn, schema) as conn:

        async def main() -> None:
            with pytest.raises(LockLost):
                async with paused.aio.hold("account:1") as stale:
                    await asyncio.to_thread(terminate_holder, dsn, paused, "account:1")
                    async with next_holder.aio.hold("account:1", timeout=PATIENCE) as lease:
                        assert lease.fence == stale.fence + 1
                        assert store_balance(conn, 1, 200, lease.fence)
                    assert not store_balance(conn, 1, 100, stale.fence)
                    with pytest.raises(LockLost):
                        paused.aio.fence("account:1")

        run(main)
        assert conn.execute("SELECT balance, fence FROM accounts").fetchone() == (200, 2)


def test_a_tasks_fences_keep_increasing_across_a_server_restart(
        make_fenced: Callable[..., Manager], dsn: str) -> None:
    locks = make_fenced()

    async def main() -> None:
        await locks.aio.acquire("k")
        fence = locks.aio.fence("k")
        await asyncio.to_thread(pgserver.restart, dsn)
        with pytest.raises(LockLost):
            await locks.aio.release("k")
        async with locks.aio.hold("k", timeout=PATIENCE) as lease:  # a new session
            assert lease.fence == fence + 1

    run(main)


def test_rw_tasks_fence_writes_only(make_fenced: Callable[..., Any]) -> None:
    rw = make_fenced(postgres.PgRWLockManager)

    async def main() -> None:
        async with rw.aio.read("k") as lease:
            with pytest.raises(LockError, match="reading"):
                lease.fence
            with pytest.raises(LockError, match="reading"):
                rw.aio.fence("k")
        async with rw.aio.hold_many(reads=["r"], writes=["w"]) as lease:
            assert lease.fences == {"w": 1}

    run(main)


def test_a_task_takes_one_round_trip_per_first_acquire_and_last_release(
        fenced: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    from lockmgr.postgres._aio_link import _AsyncLink

    aio = fenced.aio
    calls: list[Callable[[], Any]] = [
        lambda: aio.acquire("k"), lambda: aio.acquire("k", timeout=0),
        lambda: aio.acquire("k", timeout=PATIENCE), lambda: aio.acquire_many(["a", "b"]),
        lambda: aio.acquire_many(["a", "b"], timeout=0),
        lambda: aio.acquire_many(["a", "b"], timeout=PATIENCE)]
    round_trip = _AsyncLink._round_trip_async
    counted: list[object] = []

    async def counting(link: Any, *args: Any) -> Any:
        counted.append(args[0])
        return await round_trip(link, *args)

    async def main() -> None:
        for call in calls:  # the connection made, the table made, the statements prepared
            assert await call()
            await aio.release_all()
        monkeypatch.setattr(_AsyncLink, "_round_trip_async", counting)
        for number, call in enumerate(calls):
            counted.clear()
            assert await call()
            assert len(counted) == 1
            assert await aio.acquire("k" if number < 3 else "a", timeout=0)  # reentrant
            await aio.release_all()
            assert len(counted) == 2

    run(main)
