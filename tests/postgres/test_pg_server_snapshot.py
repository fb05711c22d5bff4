"""Who holds what across processes: lockmgr's connections name themselves on the server
(``application_name``), and ``snapshot(server=True)`` shows the holders and waiters of each
key of the manager's namespace, whichever process they are in. Against a real server."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import pgserver  # noqa: F401  (first: it skips this module where psycopg cannot load libpq)
import psycopg
from conftest import PATIENCE, wait_until
from lockmgr import postgres
from lockmgr.postgres._inspect import application_name
from pg_support import _waiting_on_server, child, expect, finish, in_loop_thread

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


def application_of(dsn: str, manager: Any, key: object) -> str:
    """The application_name of the session holding ``key``."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1"
            " AND ((l.classid::bigint << 32) | l.objid::bigint) = %s",
            (manager.advisory_key(key),)).fetchone()
    assert row is not None, f"nobody holds {key!r}"
    return str(row[0])


def test_lockmgr_connections_are_named_by_namespace_unless_the_application_names_them(
        engine, dsn, namespace, monkeypatch) -> None:
    ours = application_name(namespace)
    assert ours.startswith("lockmgr ") and ours != application_name(namespace + "-other")
    assert namespace not in ours
    named = postgres.PgLockManager(dsn, namespace=namespace,
                                   connect_kwargs={"application_name": "billing"})
    in_dsn = postgres.PgRWLockManager(f"{dsn}?application_name=billing-dsn", namespace=namespace)
    locks = postgres.PgLockManager(dsn, namespace=namespace)
    seen: dict[str, str] = {}

    async def main() -> None:
        async with locks.aio.hold("task"):
            seen["task"] = await asyncio.to_thread(application_of, dsn, locks, "task")

    try:
        with locks.hold("thread"), named.hold("named"), in_dsn.write("in dsn"):
            seen["thread"] = application_of(dsn, locks, "thread")
            seen["named"] = application_of(dsn, locks, "named")
            seen["in dsn"] = application_of(dsn, locks, "in dsn")
        loop_thread, failures = in_loop_thread(main)
        loop_thread.join(PATIENCE * 3)
        assert not failures, failures
        assert seen == {"thread": ours, "task": ours, "named": "billing", "in dsn": "billing-dsn"}
        monkeypatch.setenv("PGAPPNAME", "from the environment")  # libpq's, read at connect
        locks.close()  # (its idle connections were named before)
        with locks.hold("environment"):
            assert application_of(dsn, locks, "environment") == "from the environment"
    finally:
        for manager in (locks, named, in_dsn):
            manager.close()


HOLDS = """
locks.acquire_write("k")
locks.acquire_write("k2")
locks.acquire_read("r")
locks.acquire_write("unknown here")
say(pid=locks._session().link.backend)
sys.stdin.readline()
locks.release_all()
"""


def test_the_server_snapshot_shows_other_processes_holders_and_this_ones_waiters(
        engine, dsn, namespace) -> None:
    """A child holds k, k2, r (read) and a key this process never names; a thread of this
    process waits for k, a task for k2. Another namespace's child, and a session that is
    not lockmgr's, hold keys too: not this namespace's, they are not shown (unless asked
    for by key)."""
    pure = engine.__name__ == "lockmgr._pure"
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holder = child(dsn, namespace, HOLDS, cls="PgRWLockManager", pure=pure)
    other = child(dsn, namespace + "-other", HOLDS, cls="PgRWLockManager", pure=pure)
    stranger = psycopg.connect(dsn, autocommit=True, application_name="someone else")
    try:
        holder_pid = expect(holder)["pid"]
        expect(other)
        # (the test names keys by the module's advisory_key: the manager's remembers str keys)
        def ident(key: str) -> int:
            return postgres.advisory_key(key, namespace)

        stranger.execute("SELECT pg_advisory_lock(%s)", (ident("stranger's"),))
        assert locks.snapshot() == [] and locks.snapshot(server=False) == []

        async def task_waits() -> None:
            assert await locks.aio.acquire("k2", timeout=PATIENCE * 2)
            await locks.aio.release("k2")

        loop_thread, task_failures = in_loop_thread(task_waits)
        thread_failures: list[BaseException] = []

        def thread_waits() -> None:
            try:
                assert locks.acquire("k", timeout=PATIENCE * 2)
                locks.release("k")
            except BaseException as error:
                thread_failures.append(error)

        waiter = threading.Thread(target=thread_waits)
        waiter.start()
        wait_until(lambda: _waiting_on_server(dsn) == 2, "the thread and the task wait")
        ours = {session.link.backend for session in locks._sessions if session.link}
        ours |= {session.link.backend for session in locks._tasks.sessions.values()
                 if session.link}
        assert len(ours) == 2

        listed = locks.snapshot(server=True)
        states = {state.advisory_key: state for state in listed}
        named = {ident(key): key for key in ("k", "k2")}  # those this process waits for
        unnamed = {ident("r"), ident("unknown here")}
        assert set(states) == {*named, *unnamed}  # neither the other namespace's nor the stranger's
        assert [state.advisory_key for state in listed] == sorted(states)
        for advisory, state in states.items():
            assert state.key == named.get(advisory)  # keys this process does not know: None
            [holding] = state.holders
            assert holding.pid == holder_pid and holding.application == application_name(namespace)
            assert holding.host == "127.0.0.1" and holding.port and holding.since is not None
            assert holding.mode == ("read" if advisory == ident("r") else "write")
        for key in ("k", "k2"):
            [waiting] = states[ident(key)].waiters
            assert waiting.pid in ours and waiting.mode == "write"
            assert waiting.application == application_name(namespace)
            holding = states[ident(key)].holders[0]
            assert waiting.since is not None and holding.since is not None
            assert holding.since <= waiting.since  # it held before they came
        assert not any(states[advisory].waiters for advisory in unnamed)

        # Keys named are known: the unknown ones, and the stranger's (a session by another name).
        asked = {state.advisory_key: state for state in
                 locks.snapshot(server=True, keys=["r", "unknown here", "stranger's"])}
        assert asked[ident("r")].key == "r" and asked[ident("unknown here")].key == "unknown here"
        stranger_state = asked[ident("stranger's")]
        assert stranger_state.key == "stranger's"
        assert [session.application for session in stranger_state.holders] == ["someone else"]

        finish(holder)
        waiter.join(PATIENCE)
        loop_thread.join(PATIENCE * 3)
        assert not thread_failures and not task_failures, (thread_failures, task_failures)
        finish(other)
        stranger.execute("SELECT pg_advisory_unlock_all()")
        assert locks.snapshot(server=True) == []
    finally:
        stranger.close()
        locks.close()


def test_a_task_sees_the_server_snapshot_from_a_thread(engine, dsn, namespace) -> None:
    """A task's own holding, in its namespace, read without blocking its loop."""
    locks: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)

    async def main() -> None:
        async with locks.aio.read("shared"):
            states = await asyncio.to_thread(locks.snapshot, server=True)
            [state] = states
            assert state.key == "shared" and [h.mode for h in state.holders] == ["read"]
            [task_session] = locks._tasks.sessions.values()
            assert state.holders[0].pid == task_session.link.backend

    try:
        loop_thread, failures = in_loop_thread(main)
        loop_thread.join(PATIENCE * 3)
        assert not failures, failures
    finally:
        locks.close()
