"""What the PostgreSQL backend pins and refuses at connect, against real servers: settings a
role, a database or the DSN would give a session are replaced by the ones locks depend on;
a standby, and a pooler between the process and the server, are refused with an error that
names the cause; fences live in one schema-qualified table whatever the role."""

from __future__ import annotations

import _thread
import asyncio
import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pgserver
from conftest import PATIENCE, wait_until
from lockmgr import DeadlockError, LockLost

import psycopg
from lockmgr import postgres
from lockmgr.postgres import _link
from lockmgr.postgres._link import _Link
from lockmgr.postgres._sql import _GRANTED_ADVISORY
from lockmgr.postgres._aio_link import _AsyncLink
from pg_support import held_on_server, run, _waiting_on_server

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


def admin(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


@pytest.fixture
def make_role(dsn: str) -> Iterator[Callable[..., str]]:
    """Login roles of the test's own, each with a schema of its name (first in its default
    search_path, "$user"); ``settings`` become the role's defaults (ALTER ROLE … SET)."""
    made: list[str] = []

    def make(**settings: str) -> str:
        role = f"lockmgr_{uuid.uuid4().hex[:12]}"
        made.append(role)
        admin(dsn, f"CREATE ROLE {role} LOGIN", f"CREATE SCHEMA AUTHORIZATION {role}",
              *(f"ALTER ROLE {role} SET {name} = '{value}'" for name, value in settings.items()))
        return role

    yield make
    for role in made:
        admin(dsn, f"DROP OWNED BY {role} CASCADE", f"DROP ROLE {role}")


def as_role(role: str) -> dict[str, Any]:
    return {"user": role}


def ended_by_server(dsn: str, pid: int) -> Callable[[], bool]:
    def ended() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                               (pid,)).fetchone()
        return bool(row and row[0] == 0)
    return ended


# -- settings are pinned ----------------------------------------------------------------------


@pytest.mark.parametrize("source", ["role", "dsn"])
def test_an_idle_session_timeout_never_ends_a_holding_session(engine, dsn, namespace,
                                                              make_role, source) -> None:
    """An ``idle_session_timeout`` the role (or the DSN) sets would end a holder's idle
    session and let another process in. A session of that role with the server's default
    is ended meanwhile; the manager's is not: the key stays held, and is released without
    LockLost."""
    role = make_role(**({"idle_session_timeout": "200ms"} if source == "role" else {}))
    options = {} if source == "role" else {"options": "-c idle_session_timeout=200"}
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, on_lost=lost.append,
        connect_kwargs={**as_role(role), **options})
    locks.acquire("k")
    with psycopg.connect(dsn, autocommit=True, **as_role(role), **options) as unpinned:
        pid = unpinned.info.backend_pid
        wait_until(ended_by_server(dsn, pid), "the server ends an idle session of the role")
    assert held_on_server(dsn, locks, "k") and locks.lost_keys() == set()
    locks.release("k")
    assert lost == [] and not held_on_server(dsn, locks, "k")
    locks.close()


@pytest.mark.parametrize("source", ["role", "dsn"])
def test_a_statement_timeout_never_ends_a_wait_without_one(engine, dsn, namespace, make_role,
                                                           workers, source) -> None:
    """A ``statement_timeout`` would cancel a wait that has no timeout. A statement of the
    role's own is cancelled meanwhile; the manager's wait goes on until the key is free."""
    role = make_role(**({"statement_timeout": "300ms"} if source == "role" else {}))
    options = {} if source == "role" else {"options": "-c statement_timeout=300"}
    holder: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    waiting: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, connect_kwargs={**as_role(role), **options})
    holder.acquire("k")
    waiter = workers("waiter")
    call = waiter.submit(lambda: waiting.acquire("k"))
    wait_until(lambda: _waiting_on_server(dsn) == 1, "the waiter waits on the server")
    with psycopg.connect(dsn, autocommit=True, **as_role(role), **options) as unpinned:
        with pytest.raises(psycopg.errors.QueryCanceled):
            unpinned.execute(f"SELECT pg_sleep({PATIENCE})")
    assert _waiting_on_server(dsn) == 1 and not call.done()
    holder.release("k")
    assert call.result() is True
    waiter.run(lambda: waiting.release("k"))
    holder.close()
    waiting.close()


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
@pytest.mark.parametrize("how", ["untimed", "timed", "many"])
def test_queued_fenced_waits_under_a_stricter_default_isolation_get_their_fences(
        engine, dsn, namespace, make_role, workers, isolation, how) -> None:
    """A role whose ``default_transaction_isolation`` is repeatable read or serializable:
    a queued fenced wait would read the fence row with a snapshot from before its wait and
    fail with SerializationFailure. Three waiters queue behind a holder; each gets the
    next fence in turn."""
    role = make_role(default_transaction_isolation=isolation)
    table = f"{role}.lockmgr_fences"
    managers = [postgres.PgLockManager(dsn, namespace=namespace, fencing=True,
                                       fence_table=table, connect_kwargs=as_role(role))
                for _ in range(4)]
    holder, waiting = managers[0], managers[1:]
    with holder.hold("k") as lease:
        fences = [lease.fence]
        threads = [workers(f"waiter {n}") for n in range(len(waiting))]

        def take(manager: postgres.PgLockManager[Any]) -> Callable[[], int]:
            def run() -> int:
                if how == "many":
                    assert manager.acquire_many(["k", "other"], timeout=PATIENCE)
                else:
                    assert manager.acquire("k", timeout=PATIENCE if how == "timed" else -1)
                return manager.fence("k")
            return run

        calls = []
        for number, (thread, manager) in enumerate(zip(threads, waiting, strict=True)):
            calls.append(thread.submit(take(manager)))
            wait_until(lambda n=number: _waiting_on_server(dsn) == n + 1, "the waiter queues")
    for thread, manager, call in zip(threads, waiting, calls, strict=False):
        fences.append(call.result())  # a waiter is granted only once the one before released
        if how == "many":
            thread.run(lambda manager=manager: manager.release_many(["k", "other"]))
        else:
            thread.run(lambda manager=manager: manager.release("k"))
    assert fences == sorted(fences) and len(set(fences)) == 4
    for manager in managers:
        manager.close()


# -- one fence table --------------------------------------------------------------------------


@pytest.mark.parametrize("table", [None, "shared_fences.counters"], ids=["default", "given"])
def test_fences_increase_across_roles_with_tables_of_their_own_on_their_search_path(
        engine, dsn, namespace, make_role, table) -> None:
    """Two roles, each with a schema of its name first on its search_path holding a
    ``lockmgr_fences`` of its own (as an unqualified name would have made): their
    managers still take fences from one table (``public.lockmgr_fences`` unless
    ``fence_table`` names another), so a key's fences increase from holder to holder."""
    roles = [make_role(), make_role()]
    schema, name = (table or postgres.DEFAULT_FENCE_TABLE).split(".")
    shared = f"{schema}.{name}"  # another test's fenced managers may have made it already
    admin(dsn, f"CREATE SCHEMA IF NOT EXISTS {schema}",
          f"CREATE TABLE IF NOT EXISTS {shared} (key bigint PRIMARY KEY, fence bigint NOT NULL)",
          *(f"GRANT USAGE ON SCHEMA {schema} TO {role}" for role in roles),
          *(f"GRANT SELECT, INSERT, UPDATE ON {shared} TO {role}" for role in roles))
    for role in roles:
        with psycopg.connect(dsn, autocommit=True, **as_role(role)) as own:
            own.execute("CREATE TABLE lockmgr_fences (key bigint PRIMARY KEY, fence bigint NOT NULL)")
    try:
        fences = []
        for role in [*roles, *roles]:
            manager: postgres.PgLockManager[Any] = postgres.PgLockManager(
                dsn, namespace=namespace, fencing=True, connect_kwargs=as_role(role),
                **({} if table is None else {"fence_table": table}))
            with manager.hold("k") as lease:
                fences.append(lease.fence)
            manager.close()
        assert fences == [1, 2, 3, 4]
        with psycopg.connect(dsn, autocommit=True) as conn:
            for role in roles:
                row = conn.execute(f"SELECT count(*) FROM {role}.lockmgr_fences").fetchone()
                assert row == (0,)
    finally:
        admin(dsn, *([f"DROP SCHEMA {schema} CASCADE"] if schema != "public" else
                     [f"REVOKE ALL ON {shared} FROM {role}" for role in roles]))


@pytest.mark.parametrize("table", ["lockmgr_fences", "a.b.c", ".t", "s.", 5],
                         ids=["unqualified", "three-parts", "no-schema", "no-table", "int"])
def test_a_fence_table_that_is_not_schema_dot_table_is_refused(dsn, table) -> None:
    with pytest.raises(TypeError if isinstance(table, int) else ValueError,
                       match="fence_table must"):
        postgres.PgLockManager(dsn, fencing=True, fence_table=table)


def test_a_fence_table_name_is_quoted(engine, dsn, namespace) -> None:
    """Names are identifiers, never SQL: quotes and capitals are kept as given."""
    admin(dsn, 'CREATE SCHEMA "Odd ""Schema"""')
    try:
        manager: postgres.PgLockManager[Any] = postgres.PgLockManager(
            dsn, namespace=namespace, fencing=True, fence_table='Odd "Schema".Fen\'ces')
        with manager.hold("k") as first, manager.hold("j") as other:
            assert (first.fence, other.fence) == (1, 1)
        manager.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute('SELECT count(*) FROM "Odd ""Schema"""."Fen\'ces"').fetchone() == (2,)
    finally:
        admin(dsn, 'DROP SCHEMA "Odd ""Schema""" CASCADE')


# -- every round trip has a deadline ----------------------------------------------------------


@contextlib.contextmanager
def stopped_backend(dsn: str, manager: Any, key: object) -> Iterator[int]:
    """The backend holding ``key`` stopped (SIGSTOP: the kernel still acknowledges its
    packets, so keepalives see nothing) until the block ends; yields its pid."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT pid FROM {_GRANTED_ADVISORY} %s",
                           (manager.advisory_key(key),)).fetchone()
    assert row is not None
    pid = int(row[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.posix_only
@pytest.mark.parametrize("timeout", [0, 0.3], ids=["try", "timed"])
@pytest.mark.parametrize("keys", [1, 2], ids=["one", "many"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_timed_call_on_a_stopped_backend_returns_by_its_deadline(
        engine, dsn, namespace, owner, keys, timeout) -> None:
    """A timed call (or a try) whose backend stops answering returns False by its deadline
    plus at most a second; the connection is closed, so what the session held is lost
    (LockLost at its release) and the server frees it once the backend goes on."""
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, on_lost=lost.append)
    wanted = ["x", "y"][:keys]

    def take() -> float:
        began = time.monotonic()
        got = (locks.acquire_many(wanted, timeout=timeout) if keys > 1
               else locks.acquire(wanted[0], timeout=timeout))
        assert got is False
        return time.monotonic() - began

    async def take_in_task() -> float:
        began = time.monotonic()
        got = (await locks.aio.acquire_many(wanted, timeout=timeout) if keys > 1
               else await locks.aio.acquire(wanted[0], timeout=timeout))
        assert got is False
        return time.monotonic() - began

    async def hold_and_take() -> None:
        await locks.aio.acquire("held")
        with stopped_backend(dsn, locks, "held"):
            took.append(await take_in_task())
        with pytest.raises(LockLost):
            await locks.aio.release("held")

    took: list[float] = []
    if owner == "thread":
        locks.acquire("held")
        with stopped_backend(dsn, locks, "held"):
            took.append(take())
        with pytest.raises(LockLost):
            locks.release("held")
    else:
        asyncio.run(hold_and_take())
    # The bound is _WAIT_MARGIN + _CANCEL_GRACE (0.5 s); the rest is slack for a loaded
    # machine. Without deadlines the call returned only when the backend went on.
    assert took[0] <= timeout + 2.0, f"returned {took[0]:.2f} s after its call"
    assert lost == [["held"]]
    wait_until(lambda: not held_on_server(dsn, locks, "held"), "the server frees the key")
    assert locks.acquire("held", timeout=PATIENCE) is True  # a new connection
    locks.release("held")
    locks.close()


@pytest.mark.posix_only
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_release_on_a_stopped_backend_ends_with_its_connection(
        engine, dsn, namespace, owner, monkeypatch) -> None:
    """A release (a round trip that waits for no lock) gives up after ``_ANSWER_WITHIN``:
    the connection is closed, and the release raises LockLost (the key may have been
    freed before it: the holder cannot tell)."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)

    def answer_within_half_a_second() -> None:  # once connected: setting up takes its time
        monkeypatch.setattr(_link, "_ANSWER_WITHIN", 0.5)

    async def in_task() -> None:
        await locks.aio.acquire("k")
        answer_within_half_a_second()
        with stopped_backend(dsn, locks, "k"):
            with pytest.raises(LockLost):
                await locks.aio.release("k")

    if owner == "thread":
        locks.acquire("k")
        answer_within_half_a_second()
        with stopped_backend(dsn, locks, "k"):
            with pytest.raises(LockLost):
                locks.release("k")
    else:
        asyncio.run(in_task())
    assert not locks.owned("k") and len(locks) == 0
    wait_until(lambda: not held_on_server(dsn, locks, "k"), "the server frees the key")
    locks.close()


# -- a standby and a pooler are refused -------------------------------------------------------


@pytest.fixture(scope="module")
def standby(dsn: str) -> Iterator[str]:
    with pgserver.running_standby(dsn) as running:
        yield running


@pytest.fixture(scope="module")
def transaction_pooler(dsn: str) -> Iterator[str]:
    with pgserver.running_pgbouncer(dsn, pool_mode="transaction") as running:
        yield running


@pytest.fixture(scope="module")
def session_pooler(dsn: str) -> Iterator[str]:
    with pgserver.running_pgbouncer(dsn, pool_mode="session") as running:
        yield running


def both_hosts(first: str, second: str) -> str:
    """A multi-host DSN without target_session_attrs: libpq takes the first that answers."""
    def host(dsn: str) -> str:
        return dsn.split("@", 1)[1].split("/", 1)[0]
    return f"postgresql://postgres@{host(first)},{host(second)}/postgres"


CALLS: dict[str, Callable[[Any], object]] = {
    "acquire": lambda locks: locks.acquire("k"),
    "try": lambda locks: locks.acquire("k", timeout=0),
    "timed": lambda locks: locks.acquire("k", timeout=PATIENCE),
    "many": lambda locks: locks.acquire_many(["k", "j"]),
    "locked": lambda locks: locks.locked("k"),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("target", ["standby", "standby first of two hosts",
                                    "transaction pooler", "session pooler"])
def test_a_dsn_reaching_a_standby_or_a_pooler_is_refused(engine, request, dsn, namespace,
                                                        target, call) -> None:
    """A standby's advisory locks are its own, and a pooler may run the next statement on
    another server session: both would let a second holder in. Every call that connects
    raises UnsafeServerError naming the cause and the fix; nothing is held or kept."""
    reached = {"standby": lambda: request.getfixturevalue("standby"),
               "standby first of two hosts": lambda: both_hosts(
                   request.getfixturevalue("standby"), dsn),
               "transaction pooler": lambda: request.getfixturevalue("transaction_pooler"),
               "session pooler": lambda: request.getfixturevalue("session_pooler")}[target]()
    cause = "standby" if target.startswith("standby") else "connection pooler"
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(reached, namespace=namespace)
    for _ in range(2):  # and again: nothing was kept of the first try
        with pytest.raises(postgres.UnsafeServerError, match=cause):
            CALLS[call](locks)
    assert len(locks) == 0 and not locks.owned("k") and locks._idle == []
    with pytest.raises(postgres.UnsafeServerError, match=cause):
        asyncio.run(locks.aio.acquire("k"))
    assert len(locks) == 0
    locks.close()


def test_a_multi_host_dsn_asking_for_the_primary_is_served(engine, dsn, namespace,
                                                           standby) -> None:
    """The fix the standby error names: target_session_attrs=read-write."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        both_hosts(standby, dsn) + "?target_session_attrs=read-write", namespace=namespace)
    with locks.hold("k"):
        assert held_on_server(dsn, locks, "k")
    locks.close()


# -- a search_path never shadows PostgreSQL's functions -----------------------------------------


# Look-alikes of the functions lockmgr calls, each pretending to succeed, and of the
# bigint "=" (never equal): a schema first on a session's search_path (the DSN's options,
# the role's defaults) puts them before pg_catalog's, so an unqualified call or operator
# runs them instead.
_SHADOWS = (
    "FUNCTION {schema}.never_equal(bigint, bigint) RETURNS boolean LANGUAGE sql"
    " AS 'SELECT false'",
    "OPERATOR {schema}.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = {schema}.never_equal)",
    "FUNCTION {schema}.pg_is_in_recovery() RETURNS boolean LANGUAGE sql AS 'SELECT false'",
    *(f"FUNCTION {{schema}}.{name}(bigint) RETURNS void LANGUAGE plpgsql AS 'BEGIN END'"
      for name in ("pg_advisory_lock", "pg_advisory_lock_shared", "pg_advisory_xact_lock",
                   "pg_advisory_xact_lock_shared")),
    *(f"FUNCTION {{schema}}.{name}(bigint) RETURNS boolean LANGUAGE sql AS 'SELECT true'"
      for name in ("pg_try_advisory_lock", "pg_try_advisory_lock_shared",
                   "pg_try_advisory_xact_lock", "pg_try_advisory_xact_lock_shared",
                   "pg_advisory_unlock", "pg_advisory_unlock_shared")),
)


@pytest.fixture
def shadowing(dsn: str) -> Iterator[dict[str, str]]:
    """Connection arguments whose search_path puts a schema of look-alikes (``_SHADOWS``)
    before pg_catalog; made on the primary (a standby gets it by replication)."""
    schema = f"shim_{uuid.uuid4().hex[:12]}"
    admin(dsn, f"CREATE SCHEMA {schema}",
          *("CREATE " + shadow.format(schema=schema) for shadow in _SHADOWS))
    try:
        yield {"options": f"-csearch_path={schema},pg_catalog"}
    finally:
        admin(dsn, f"DROP SCHEMA {schema} CASCADE")


def shadowed(dsn: str, shadowing: dict[str, str]) -> bool:
    """Whether an unqualified call on a session of ``shadowing``'s reaches a look-alike."""
    with psycopg.connect(dsn, autocommit=True, **shadowing) as conn:
        row = conn.execute("SELECT n.nspname FROM pg_catalog.pg_proc p JOIN"
                           " pg_catalog.pg_namespace n ON n.oid = p.pronamespace"
                           " WHERE p.oid = 'pg_is_in_recovery()'::pg_catalog.regprocedure"
                           ).fetchone()
    return bool(row and row[0] != "pg_catalog")


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_standby_is_refused_whatever_the_search_path(engine, dsn, namespace, standby,
                                                       shadowing, owner) -> None:
    """A ``pg_is_in_recovery()`` of a schema first on the search_path, answering false,
    does not pass a standby off as a primary."""
    wait_until(lambda: shadowed(standby, shadowing), "the standby has the look-alikes")
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        standby, namespace=namespace, connect_kwargs=shadowing)
    with pytest.raises(postgres.UnsafeServerError, match="standby"):
        if owner == "thread":
            locks.acquire("k")
        else:
            asyncio.run(locks.aio.acquire("k"))
    assert len(locks) == 0 and locks._idle == []
    locks.close()


def one_key(take: Callable[[Any], object], give_back: Callable[[Any], object]
            ) -> tuple[list[str], Callable[[Any], object], Callable[[Any], object]]:
    return ["k"], take, give_back


def two_keys(**timeout: float) -> tuple[list[str], Callable[[Any], object], Callable[[Any], object]]:
    return (["k", "j"], lambda locks: locks.acquire_many(["k", "j"], **timeout),
            lambda locks: locks.release_many(["k", "j"]))


# Each call of a manager (PgLockManager's, but a read's PgRWLockManager's): the keys it
# takes, how it takes them, how it gives them back.
SHADOWED_CALLS: dict[str, tuple[list[str], Callable[[Any], object], Callable[[Any], object]]] = {
    "acquire": one_key(lambda locks: locks.acquire("k"), lambda locks: locks.release("k")),
    "try": one_key(lambda locks: locks.acquire("k", timeout=0), lambda locks: locks.release("k")),
    "timed": one_key(lambda locks: locks.acquire("k", timeout=PATIENCE),
                     lambda locks: locks.release("k")),
    "many": two_keys(),
    "try many": two_keys(timeout=0),
    "timed many": two_keys(timeout=PATIENCE),
    "read": one_key(lambda locks: locks.acquire_read("k"), lambda locks: locks.release_read("k")),
    "try read": one_key(lambda locks: locks.acquire_read("k", timeout=0),
                        lambda locks: locks.release_read("k")),
}


@pytest.mark.parametrize("fencing", [False, True], ids=["plain", "fenced"])
@pytest.mark.parametrize("call", sorted(SHADOWED_CALLS))
def test_locks_are_taken_and_released_on_the_server_whatever_the_search_path(
        engine, dsn, namespace, shadowing, call, fencing) -> None:
    """Look-alikes of the advisory lock functions first on the search_path (doing nothing,
    and saying so) do not stand in for PostgreSQL's: each key is held on the server, a
    manager of another session cannot take it, and the release frees it."""
    assert shadowed(dsn, shadowing)
    keys, take, give_back = SHADOWED_CALLS[call]
    kind = postgres.PgRWLockManager if "read" in call else postgres.PgLockManager
    locks: Any = kind(dsn, namespace=namespace, fencing=fencing, connect_kwargs=shadowing)
    other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    assert take(locks)
    assert all(held_on_server(dsn, locks, key) for key in keys)
    assert not any(other.acquire(key, timeout=0) for key in keys)
    give_back(locks)
    assert not any(held_on_server(dsn, locks, key) for key in keys)
    locks.close()
    other.close()


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_key_held_elsewhere_is_locked_whatever_the_search_path(engine, dsn, namespace,
                                                                 shadowing, owner) -> None:
    """``locked`` compares advisory keys with "=": an "=" of a schema first on the
    search_path, never equal, does not hide a key another session holds."""
    assert shadowed(dsn, shadowing)
    holder: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, connect_kwargs=shadowing)
    with holder.hold("k"):
        assert (locks.locked("k") if owner == "thread" else asyncio.run(locks.aio.locked("k")))
    holder.close()
    locks.close()


@pytest.mark.parametrize("timeout", [None, 0, PATIENCE], ids=["untimed", "try", "timed"])
def test_xact_lock_takes_the_lock_on_the_server_whatever_the_search_path(
        engine, dsn, namespace, shadowing, timeout) -> None:
    """On the caller's connection, whose search_path puts look-alikes first: the lock is
    PostgreSQL's, and the caller's search_path is left as it was."""
    assert shadowed(dsn, shadowing)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    with psycopg.connect(dsn, autocommit=True, **shadowing) as conn:
        search_path = conn.execute("SHOW search_path").fetchone()
        with conn.transaction():
            with locks.xact_lock(conn, "k", timeout=timeout):
                assert held_on_server(dsn, locks, "k")
        assert not held_on_server(dsn, locks, "k")
        assert conn.execute("SHOW search_path").fetchone() == search_path
    locks.close()


# -- xact_lock's transactions are known across roles -----------------------------------------


@pytest.mark.parametrize("timeout", [0, 0.2], ids=["try", "timed"])
def test_a_session_lock_of_a_key_taken_with_xact_lock_as_another_role_is_refused_at_once(
        engine, dsn, namespace, make_role, timeout) -> None:
    """The manager logs in as a role of its own, the caller's connection as another: the
    server hides that connection's transaction from the manager's role
    (pg_stat_activity), not its locks. A thread, and a task, that took "k" with
    xact_lock in a transaction still open are refused a session lock of it at once (it
    would wait for itself); once the transaction ended, it is taken."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(
        dsn, namespace=namespace, connect_kwargs=as_role(make_role()))

    async def in_a_task() -> None:
        with conn.transaction():
            with rw.xact_lock(conn, "k"):
                pass
            with pytest.raises(DeadlockError, match="calling task holds .* xact_lock"):
                await rw.aio.acquire_read("k", timeout=timeout)
        assert await rw.aio.acquire_write("k", timeout=timeout)
        await rw.aio.release_write("k")

    with psycopg.connect(dsn) as conn:
        with conn.transaction():
            with rw.xact_lock(conn, "k", shared=True):
                pass
            with pytest.raises(DeadlockError, match="calling thread holds .* xact_lock"):
                rw.acquire_write("k", timeout=timeout)
            assert rw.acquire_read("k", timeout=timeout)  # shared beside a read
            rw.release_read("k")
        assert rw.acquire_write("k", timeout=timeout)  # committed: the xact lock went with it
        rw.release_write("k")
        run(in_a_task)
    assert not held_on_server(dsn, rw, "k")
    rw.close()


# -- a lost connection fails the whole call ---------------------------------------------------


def terminate_waiting_sessions(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(pid) FROM pg_locks"
                     " WHERE locktype = 'advisory' AND NOT granted")


@pytest.mark.parametrize("fencing", [False, True], ids=["plain", "fenced"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_set_whose_reentered_key_is_lost_while_it_waits_fails_with_lock_lost(
        engine, dsn, namespace, workers, owner, fencing) -> None:
    """A thread (or task) holding "a" asks for {"a", "b"}; its connection dies while the
    call waits for "b". "a" went with the connection, so the call must fail with LockLost,
    holding nothing of it, even once a new connection could take "b"."""
    holder: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                fencing=fencing)
    holder.acquire("b")
    waiter = workers("waiter")

    def in_thread() -> list[str]:
        locks.acquire("a")
        outcome = []
        try:
            locks.acquire_many(["a", "b"])
            outcome.append("granted")
        except LockLost as error:
            outcome.append(str(error))
        outcome.append(repr(locks.owned("b")))
        try:
            locks.release("a")
        except LockLost:
            outcome.append("a lost")
        return outcome

    async def in_task() -> list[str]:
        await locks.aio.acquire("a")
        outcome = []
        try:
            await locks.aio.acquire_many(["a", "b"])
            outcome.append("granted")
        except LockLost as error:
            outcome.append(str(error))
        outcome.append(repr(locks.aio.owned("b")))
        try:
            await locks.aio.release("a")
        except LockLost:
            outcome.append("a lost")
        return outcome

    call = waiter.submit(in_thread if owner == "thread" else lambda: asyncio.run(in_task()))
    wait_until(lambda: _waiting_on_server(dsn) == 1, "the set waits for b on the server")
    terminate_waiting_sessions(dsn)
    wait_until(lambda: _waiting_on_server(dsn) == 1 or call.done(), "the call goes on")
    holder.release("b")
    assert call.result() == ["the lock on 'a' was lost with its connection", "False", "a lost"]
    assert not held_on_server(dsn, locks, "b") and not held_on_server(dsn, locks, "a")
    holder.close()
    locks.close()


@pytest.mark.posix_only
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_wait_without_a_timeout_never_returns_without_its_key(
        engine, dsn, namespace, owner, monkeypatch) -> None:
    """A wait without a timeout whose connection stops answering before the wait (the
    statement's first use prepares it) goes on on a new connection: ``with locks[key]``
    never runs its block without the key. What the old connection held is lost."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    entered: list[tuple[bool, bool]] = []

    async def in_task() -> None:
        assert await locks.aio.acquire("held", timeout=PATIENCE)  # prepares nothing
        monkeypatch.setattr(_link, "_ANSWER_WITHIN", 0.5)
        with stopped_backend(dsn, locks, "held"):
            async with locks.aio["k"]:
                entered.append((locks.aio.owned("k"), held_on_server(dsn, locks, "k")))
        with pytest.raises(LockLost):
            await locks.aio.release("held")

    if owner == "thread":
        assert locks.acquire("held", timeout=PATIENCE)
        monkeypatch.setattr(_link, "_ANSWER_WITHIN", 0.5)
        with stopped_backend(dsn, locks, "held"):
            with locks["k"]:
                entered.append((locks.owned("k"), held_on_server(dsn, locks, "k")))
        with pytest.raises(LockLost):
            locks.release("held")
    else:
        asyncio.run(in_task())
    assert entered == [(True, True)]
    locks.close()


@pytest.mark.parametrize("timeout", [0, 0.3], ids=["try", "timed"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_slow_server_times_a_call_out_and_keeps_the_connection(
        engine, dsn, namespace, owner, timeout) -> None:
    """A server that is only slow (here the fence table locked, as by a migration) past a
    timed call's deadline: the statement is cancelled, the call returns False, and what
    the session held stays held (no loss, no on_lost). Once the table is free, it works."""
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, fencing=True, on_lost=lost.append)
    migration = psycopg.connect(dsn)

    def lock_the_table() -> None:
        migration.execute(f"LOCK TABLE {postgres.DEFAULT_FENCE_TABLE} IN SHARE MODE")

    async def in_task() -> list[object]:
        assert await locks.aio.acquire("held")
        lock_the_table()
        got = await locks.aio.acquire("other", timeout=timeout)
        migration.rollback()
        again = await locks.aio.acquire("other", timeout=PATIENCE)
        await locks.aio.release("other")
        await locks.aio.release("held")
        return [got, again]

    try:
        if owner == "thread":
            assert locks.acquire("held")
            lock_the_table()
            outcome = [locks.acquire("other", timeout=timeout)]
            migration.rollback()
            outcome.append(locks.acquire("other", timeout=PATIENCE))
            locks.release("other")
            locks.release("held")
        else:
            outcome = asyncio.run(in_task())
    finally:
        migration.close()
    assert outcome == [False, True] and lost == []
    locks.close()


def test_a_fence_table_name_cannot_escape_its_quotes(engine, dsn, namespace) -> None:
    """The name is quoted as an identifier inside a literal; standard_conforming_strings
    is pinned on, so a role or DSN turning it off cannot make a backslash end the
    literal."""
    admin(dsn, "CREATE TABLE victim (x int)", "CREATE SCHEMA s")
    name = "s.x\\' || chr(34)) IS NOT NULL; DROP TABLE victim; --"
    try:
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
            dsn, namespace=namespace, fencing=True, fence_table=name,
            connect_kwargs={"options": "-c standard_conforming_strings=off"})
        with locks.hold("k") as lease:
            assert lease.fence == 1
        locks.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT count(*) FROM victim").fetchone() == (0,)
            assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 's'"
                                ).fetchone() == (1,)
    finally:
        admin(dsn, "DROP TABLE IF EXISTS victim", "DROP SCHEMA s CASCADE")


@pytest.mark.posix_only
def test_a_timed_first_fenced_write_on_a_stopped_backend_returns_by_its_deadline(
        engine, dsn, namespace) -> None:
    """A timed call's round trips before its wait (here the fence table's check, on a
    manager's first fenced write) have the call's deadline too."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace,
                                                                 fencing=True)
    rw.acquire_read("held")
    with stopped_backend(dsn, rw, "held"):
        began = time.monotonic()
        assert rw.acquire_write("k", timeout=0.3) is False
        took = time.monotonic() - began
    assert took <= 0.3 + 2.0, f"returned {took:.2f} s after its call"
    with pytest.raises(LockLost):
        rw.release_read("held")
    rw.close()


@pytest.mark.posix_only
def test_ctrl_c_on_a_stopped_backend_raises_keyboard_interrupt_by_the_deadline(
        engine, dsn, namespace, ctrl_c_raises, workers) -> None:
    """Ctrl-C during a timed call whose backend stopped: the clean-up (a cancel nobody
    answers) is bounded by the call's deadline, and the interrupt is what the caller
    gets, never the clean-up's own failure."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holding = workers("holder")  # (the caller's own lock through another manager is refused)
    try:
        holding.run(lambda: other.acquire("k"))
        locks.acquire("held")
        interrupting = threading.Timer(0.3, _thread.interrupt_main)
        with stopped_backend(dsn, locks, "held"):
            began = time.monotonic()
            interrupting.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    locks.acquire("k", timeout=3)
            finally:
                interrupting.join()
            took = time.monotonic() - began
        assert took <= 3 + 2.0, f"returned {took:.2f} s after its call"
        with pytest.raises(LockLost):
            locks.release("held")
        holding.run(lambda: other.release("k"))
    finally:
        locks.close()
        other.close()


# -- a stale probe never marks a newer connection ---------------------------------------------


def terminate_holder_of(dsn: str, manager: Any, key: object) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"SELECT pg_terminate_backend(pid) FROM {_GRANTED_ADVISORY} %s",
                     (manager.advisory_key(key),))
    wait_until(lambda: not held_on_server(dsn, manager, key), "the server ends the session")


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_stale_probe_never_marks_the_connection_its_owner_moved_on_to(
        engine, dsn, namespace, workers, monkeypatch, owner) -> None:
    """``lost_keys()`` in another thread probes each holder's connection, then marks the
    dead ones. If the holder handled its loss between the probe and the mark and took a
    key on a new connection, the mark must not hit that connection: the new key is not
    lost, and ``on_lost`` hears only of the key that was."""
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, on_lost=lost.append)
    holder, checker = workers("holder"), workers("checker")
    took_a, may_handle, moved_on, checked = (threading.Event() for _ in range(4))
    outcome: list[str] = []

    def in_thread() -> None:
        locks.acquire("a")
        took_a.set()
        assert may_handle.wait(PATIENCE)
        try:
            locks.release("a")
        except LockLost:
            outcome.append("a lost")
        locks.acquire("b")  # a new connection
        moved_on.set()
        assert checked.wait(PATIENCE)
        try:
            locks.release("b")
        except LockLost:
            outcome.append("b lost")

    async def in_task() -> None:
        await locks.aio.acquire("a")
        took_a.set()
        assert await asyncio.to_thread(may_handle.wait, PATIENCE)
        try:
            await locks.aio.release("a")
        except LockLost:
            outcome.append("a lost")
        await locks.aio.acquire("b")
        moved_on.set()
        assert await asyncio.to_thread(checked.wait, PATIENCE)
        try:
            await locks.aio.release("b")
        except LockLost:
            outcome.append("b lost")

    owning = holder.submit(in_thread if owner == "thread" else lambda: asyncio.run(in_task()))
    assert took_a.wait(PATIENCE)
    terminate_holder_of(dsn, locks, "a")
    probed, go = threading.Event(), threading.Event()
    probe = _Link.idle_unless_busy

    def pausing_probe(link: Any) -> bool | None:
        answer = probe(link)
        if threading.current_thread() is checker.thread and answer is False:
            probed.set()
            go.wait(PATIENCE)
        return answer

    monkeypatch.setattr(_Link, "idle_unless_busy", pausing_probe)
    checking = checker.submit(locks.lost_keys)
    assert probed.wait(PATIENCE), "the checker found the holder's connection dead"
    may_handle.set()  # the holder handles its loss and moves on to a new connection
    assert moved_on.wait(PATIENCE)
    go.set()
    assert checking.result() == set()
    assert lost == [["a"]] and held_on_server(dsn, locks, "b")
    checked.set()
    owning.result()
    assert outcome == ["a lost"]  # "b" was held all along
    locks.close()


# -- what a manager counts --------------------------------------------------------------------


def test_len_of_a_readers_writer_manager_counts_no_key_only_lost_readers_hold(
        engine, dsn, namespace, workers) -> None:
    """Two threads read "k"; one's connection is lost. "k" is held while the other reads,
    and no longer once it has released, though the first has not yet released its lost
    read."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    first, second = workers("first"), workers("second")
    first.run(lambda: [rw.acquire_read("k"), rw.acquire_write("mark:first")])
    second.run(lambda: rw.acquire_read("k"))
    terminate_holder_of(dsn, rw, "mark:first")
    assert rw.lost_keys() == {"k", "mark:first"}
    assert len(rw) == 1 and rw.readers("k") == 1
    second.run(lambda: rw.release_read("k"))
    assert len(rw) == 0 and rw.readers("k") == 0
    for release in (lambda: rw.release_read("k"), lambda: rw.release_write("mark:first")):
        with pytest.raises(LockLost):
            first.run(release)
    assert len(rw) == 0 and rw.lost_keys() == set()
    rw.close()


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_fenced_wait_without_a_timeout_waits_out_a_migration_of_the_fence_table(
        engine, dsn, namespace, workers, owner, monkeypatch) -> None:
    """A wait without a timeout waits for ever, the steps before it too: its first fenced
    statement's prepare waits for the fence table a migration holds, is cancelled at the
    round trip's deadline (the server answers: it is only slow) and made again, until the
    table is free; then the wait takes the key and its fence."""
    maker: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                fencing=True)
    with maker.hold("made"):  # the fence table exists
        pass
    maker.close()
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                fencing=True)
    cancels: list[bool] = []
    for link_class, name in ((_Link, "_past_deadline"),
                             (_AsyncLink, "_past_deadline_async")):
        original = getattr(link_class, name)

        def counted(link: Any, original: Any = original) -> Any:
            cancels.append(True)
            return original(link)
        monkeypatch.setattr(link_class, name, counted)

    connected, migrating = threading.Event(), threading.Event()

    async def in_task() -> int:
        # connected first (a timed call prepares nothing), holding a key so the
        # connection stays the task's
        assert await locks.aio.acquire("connected", timeout=PATIENCE)
        connected.set()
        assert await asyncio.to_thread(migrating.wait, PATIENCE)
        assert await locks.aio.acquire("k")
        fence = locks.aio.fence("k")
        await locks.aio.release("k")
        await locks.aio.release("connected")
        return fence

    def in_thread() -> int:
        assert locks.acquire("connected", timeout=PATIENCE)  # as in_task
        connected.set()
        assert migrating.wait(PATIENCE)
        assert locks.acquire("k")
        fence = locks.fence("k")
        locks.release("k")
        locks.release("connected")
        return fence

    call = workers("waiter").submit(in_thread if owner == "thread"
                                    else lambda: asyncio.run(in_task()))
    assert connected.wait(PATIENCE)
    migration = psycopg.connect(dsn)
    try:
        migration.execute(f"LOCK TABLE {postgres.DEFAULT_FENCE_TABLE} IN ACCESS EXCLUSIVE MODE")
        monkeypatch.setattr(_link, "_ANSWER_WITHIN", 0.3)
        migrating.set()
        wait_until(lambda: len(cancels) >= 2, "the prepare is cancelled, and made again")
        assert not call.done()
    finally:
        migration.rollback()
        migration.close()
    assert call.result() >= 1
    locks.close()
