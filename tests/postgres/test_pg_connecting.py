"""Connecting: what a manager checks when it is made (its DSN and ``connect_kwargs``), what a
call raises when it cannot connect (``PgConnectionError``, psycopg's error as its cause:
refused, out of connections), and how long connecting may take (a timed call's or a try's
deadline; otherwise ``connect_timeout``, else 10 s), for threads and tasks. Against real
servers, and a port that takes connections and never answers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import pgserver  # first: it skips this module where psycopg cannot load libpq
import psycopg
from conftest import PATIENCE, wait_until
from lockmgr import LockError, LockTimeout, postgres
from lockmgr.postgres import _deadlock, _protocol, _server

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")

# Slack for a loaded 2-core machine on top of a bound the call documents; an unbounded
# connect (psycopg's own default is 130 s) takes far longer than bound and slack together.
SLACK = 5.0


@contextlib.contextmanager
def silent_port() -> Iterator[str]:
    """A DSN whose port takes TCP connections and never answers (the kernel completes the
    handshakes into the listen backlog of a socket nobody accepts on): a hung server host or
    a stuck proxy, as a client sees it."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"postgresql://postgres@127.0.0.1:{listener.getsockname()[1]}/postgres"


def refused_port() -> str:
    """A DSN whose port refuses connections (nothing listens on it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"postgresql://postgres@127.0.0.1:{port}/postgres"


def outcome_within(call: Callable[[], Any], owner: str, patience: float = PATIENCE
                   ) -> tuple[Any, float]:
    """Run ``call`` (a coroutine function for a task) in a thread of its own, or as a task
    on a loop of its own there: what it returned or raised, and how long it took. A call
    that has not returned after ``patience`` fails the test (the thread is left behind)."""
    result: list[tuple[Any, float]] = []

    def body() -> None:
        began = time.monotonic()
        try:
            outcome = asyncio.run(call()) if owner == "task" else call()
        except BaseException as error:  # noqa: BLE001  (the outcome under test)
            outcome = error
        result.append((outcome, time.monotonic() - began))

    runner = threading.Thread(target=body, daemon=True)
    runner.start()
    runner.join(patience)
    assert result, f"the call had not returned after {patience} s"
    return result[0]


def acquirer(locks: postgres.PgLockManager[Any], owner: str, release: bool = False,
             **arguments: Any) -> Callable[[], Any]:
    """A call acquiring "k" in a thread or a task (with ``arguments``): what it returns,
    having released the key again if ``release``."""
    def acquire() -> bool:
        got = locks.acquire("k", **arguments)
        if got and release:
            locks.release("k")
        return got

    async def acquire_in_task() -> bool:
        got = await locks.aio.acquire("k", **arguments)
        if got and release:
            await locks.aio.release("k")
        return got

    return acquire if owner == "thread" else acquire_in_task


# -- the DSN, checked when the manager is made -------------------------------------------------


@pytest.mark.parametrize("cls", ["PgLockManager", "PgRWLockManager"])
@pytest.mark.parametrize(("dsn_given", "connect_kwargs", "error", "says"), [
    ("not a dsn", None, ValueError, 'missing "=" after "not"'),
    (None, None, TypeError, "dsn must be a str"),
    (b"host=localhost", None, TypeError, "not bytes"),
    ("host=localhost", {"no_such_option": 1}, ValueError, '"no_such_option"'),
    ("host=localhost", {"connect_timeout": "soon"}, ValueError, "connect_timeout"),
], ids=["not-a-dsn", "none", "bytes", "bad-option", "bad-connect-timeout"])
def test_a_manager_refuses_a_dsn_it_could_never_connect_with(
        engine, cls, dsn_given, connect_kwargs, error, says) -> None:
    """Made with a DSN (or connect_kwargs) libpq cannot parse, a manager raises TypeError or
    ValueError naming the problem, and nothing is made: no manager joins the process's
    (whose looks and fork hook would walk it). Before, it was made, and its first acquire
    raised psycopg's errors."""
    with pytest.raises(error, match=says):
        getattr(postgres, cls)(dsn_given, connect_kwargs=connect_kwargs)
    assert not [manager for manager in _deadlock.live_managers()
                if getattr(manager, "_dsn", None) is dsn_given]


# -- a connection refused ----------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-1, 1], ids=["untimed", "timed"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_refused_connection_raises_pg_connection_error_with_psycopgs_as_its_cause(
        engine, namespace, owner, timeout) -> None:
    """Nothing listens at the DSN's port: an acquire, timed or not, raises PgConnectionError
    (a LockError, and a ConnectionError) naming the cause, psycopg's OperationalError as its
    ``__cause__``; nothing is held. So does a question to the server (``locked``)."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(refused_port(), namespace=namespace)
    error, _ = outcome_within(acquirer(locks, owner, timeout=timeout), owner)
    assert isinstance(error, postgres.PgConnectionError), repr(error)
    assert isinstance(error, LockError) and isinstance(error, ConnectionError)
    assert "Connection refused" in str(error)
    assert isinstance(error.__cause__, psycopg.OperationalError)
    assert len(locks) == 0 and not locks.owned("k")
    with pytest.raises(postgres.PgConnectionError):
        locks.locked("k")
    locks.close()


@pytest.fixture(scope="module")
def small_server() -> Iterator[str]:
    """A server of its own with room for 4 sessions, superusers' included."""
    with pgserver.running_server("max_connections=4", "superuser_reserved_connections=0") as running:
        yield running


def sessions_on(conn: psycopg.Connection[Any]) -> int:
    """How many client sessions the server of ``conn`` has (``conn``'s own included)."""
    row = conn.execute("SELECT count(*) FROM pg_stat_activity"
                       " WHERE backend_type = 'client backend'").fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_server_out_of_connections_raises_pg_connection_error(
        engine, small_server, namespace, owner) -> None:
    """Every session the server allows is taken: an acquire raises PgConnectionError with
    PostgreSQL's "sorry, too many clients already", psycopg's OperationalError as its
    cause, and holds nothing; once a session ends, the same manager gets the key."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(small_server, namespace=namespace)
    others: list[psycopg.Connection[Any]] = []
    try:
        with pytest.raises(psycopg.OperationalError, match="too many clients"):
            while True:  # fill every slot
                others.append(psycopg.connect(small_server, autocommit=True))
        error, _ = outcome_within(acquirer(locks, owner, timeout=PATIENCE), owner)
        assert isinstance(error, postgres.PgConnectionError), repr(error)
        assert "too many clients" in str(error)
        assert isinstance(error.__cause__, psycopg.OperationalError)
        assert len(locks) == 0
        others.pop().close()  # its backend ends a moment later: wait for its slot to free
        wait_until(lambda: sessions_on(others[0]) < len(others) + 1, "a slot freed")
        got, _ = outcome_within(acquirer(locks, owner, timeout=PATIENCE, release=True), owner)
        assert got is True
    finally:
        for other in others:
            other.close()
        locks.close()


# -- how long connecting may take --------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0, 1], ids=["try", "timed"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_timed_call_gives_up_connecting_at_its_deadline(
        engine, namespace, owner, timeout, monkeypatch) -> None:
    """The DSN's server takes the TCP connection and never answers: a timed acquire times
    out (False; ``hold`` raises LockTimeout) by its deadline plus the documented half
    second, a try after its two seconds to connect, with nothing held. It used to wait for
    psycopg's connect timeout (130 s)."""
    monkeypatch.setattr(_protocol, "_TRY_CONNECTS_WITHIN", 0.5)  # (2 s by default)
    with silent_port() as dsn:
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
        got, took = outcome_within(acquirer(locks, owner, timeout=timeout), owner)
        assert got is False, repr(got)
        assert took < (timeout or _protocol._TRY_CONNECTS_WITHIN) + SLACK, \
            f"returned {took:.1f} s after its call"
        assert len(locks) == 0 and not locks.owned("k")
        if owner == "thread":
            with pytest.raises(LockTimeout):
                with locks.hold("k", timeout=timeout):
                    pass  # pragma: no cover
        locks.close()


def hosts_of(*dsns: str) -> str:
    """One DSN naming each of ``dsns``' hosts in turn, connect_timeout=1 (libpq makes it
    2 s a host)."""
    hosts = ",".join(dsn.split("@", 1)[1].split("/", 1)[0] for dsn in dsns)
    return f"postgresql://postgres@{hosts}/postgres?connect_timeout=1"


@pytest.mark.parametrize("timeout", [-1, PATIENCE], ids=["untimed", "timed"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_hung_first_host_gives_way_to_the_next(engine, dsn, namespace, owner,
                                                 timeout) -> None:
    """A DSN whose first host takes the TCP connection and never answers: its attempt
    ends after the host's connect_timeout and the second host serves the call, as libpq's
    own connect and psycopg's do. It used to spend the call's whole connect bound on the
    first host and fail (or time out) without trying the second."""
    with silent_port() as hung:
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
            hosts_of(hung, dsn), namespace=namespace)
        got, _ = outcome_within(acquirer(locks, owner, timeout=timeout, release=True), owner)
        assert got is True, repr(got)
        assert len(locks) == 0
        locks.close()


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_timed_call_ending_on_a_hung_first_host_times_out(engine, dsn, namespace,
                                                            owner) -> None:
    """The same DSN, and a call whose deadline comes before the first host's attempt
    ends: it times out by its deadline plus the documented half second, holding
    nothing."""
    with silent_port() as hung:
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
            hosts_of(hung, dsn), namespace=namespace)
        got, took = outcome_within(acquirer(locks, owner, timeout=0.5), owner)
        assert got is False, repr(got)
        assert took < 0.5 + SLACK, f"returned {took:.1f} s after its call"
        assert len(locks) == 0 and not locks.owned("k")
        locks.close()


@pytest.mark.parametrize("bound", ["connect_timeout", "default"])
@pytest.mark.parametrize("owner", ["thread", "task"])
def test_an_untimed_call_gives_up_connecting_after_its_connect_bound(
        engine, namespace, owner, bound, monkeypatch) -> None:
    """The same silent server, and a call without a timeout: its connect gives up after
    ``connect_timeout`` (2 s here), or without one after lockmgr's default (10 s, made 1 s
    here), and it raises PgConnectionError; ``locked`` (a question) too. It used to wait
    for psycopg's connect timeout (130 s)."""
    monkeypatch.setattr(_server, "_CONNECT_WITHIN", 1.0)
    seconds = 2.0 if bound == "connect_timeout" else 1.0
    options = {"connect_timeout": 2} if bound == "connect_timeout" else None
    with silent_port() as dsn:
        locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
            dsn, namespace=namespace, connect_kwargs=options)
        error, took = outcome_within(acquirer(locks, owner), owner)
        assert isinstance(error, postgres.PgConnectionError), repr(error)
        assert "did not complete a new connection in time" in str(error)
        assert took < seconds + SLACK, f"gave up {took:.1f} s after its call"
        error, took = outcome_within(lambda: locks.locked("k"), "thread")
        assert isinstance(error, postgres.PgConnectionError), repr(error)
        assert took < seconds + SLACK, f"gave up {took:.1f} s after its call"
        locks.close()
