"""Fences under synchronous replication, against real servers: a primary of this module's own
whose commits wait for a synchronous standby (what docs/postgres.md prescribes where fences
must survive a failover), and a streaming standby of each test's own, stopped while fenced
acquisitions commit, then promoted. A fence whose increment the standby did not confirm is
never handed out: the promoted standby, which never saw the increment, hands out the same
number next."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Hashable, Iterator
from typing import Any

import pytest

import pgserver  # first: it skips this module where psycopg cannot load libpq
import psycopg

from conftest import PATIENCE, wait_until
from lockmgr import LockError, postgres
from lockmgr.postgres import FenceNotDurableError, _link
from pg_support import held_on_server, own_sessions_locks

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


Manager = postgres.PgLockManager[Any]


@pytest.fixture(scope="module")
def dsn() -> Iterator[str]:
    """This module's primary, in place of pg_fixtures' server: every commit that writes
    waits for a synchronous standby, any of them (each test starts its own)."""
    with pgserver.running_server("synchronous_standby_names='*'") as running:
        yield running


@pytest.fixture
def standby(dsn: str) -> Iterator[str]:
    """A standby of the test's own, streaming, once the primary's commits wait for it."""
    with pgserver.running_standby(dsn, synchronous=True) as running:
        yield running


@pytest.fixture
def fenced(engine, dsn: str, standby: str, namespace: str) -> Iterator[Manager]:  # type: ignore[no-untyped-def]
    """A fencing manager on the primary, its fence table made (and replicated) while the
    standby runs."""
    locks: Manager = postgres.PgLockManager(dsn, namespace=namespace, fencing=True)
    with locks.hold("made"):
        pass
    yield locks
    locks.close()


def take(locks: Manager, keys: list[str], owner: str) -> dict[Hashable, int]:
    """The fences a thread or a task (``owner``) is handed for ``keys``; released at once."""
    if owner == "thread":
        with locks.hold_many(keys, timeout=PATIENCE) as lease:
            return lease.fences

    async def main() -> dict[Hashable, int]:
        async with locks.aio.hold_many(keys, timeout=PATIENCE) as lease:
            return lease.fences

    return asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))


def commit_waiting_for_the_standby(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_stat_activity"
                           " WHERE wait_event = 'SyncRep'").fetchone()
    return row == (1,)


def cancel_the_commits_wait(dsn: str) -> None:
    """Cancel, from a session of its own, the wait of the one commit that waits for the
    standby, as an administrator would."""
    wait_until(lambda: commit_waiting_for_the_standby(dsn), "a commit waits for the standby")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                      " WHERE wait_event = 'SyncRep'")


def fails_holding_nothing(locks: Manager, dsn: str, keys: list[str], timeout: float | None,
                          owner: str) -> str:
    """A fenced acquisition of ``keys`` by a thread or a task (``owner``) whose commit the
    stopped standby cannot confirm fails with FenceNotDurableError by its deadline (a
    generous hang bound: within ``timeout`` + PATIENCE); a wait without a timeout
    (``timeout`` None) fails once another session cancels the commit's wait. The owner,
    still running, then holds nothing, in process or on the primary. Returns the error's
    message."""

    def nothing_held() -> None:
        assert len(locks) == 0 and not any(key in locks for key in keys)
        assert own_sessions_locks(dsn) == 0
        assert not any(held_on_server(dsn, locks, key) for key in keys)

    seconds = -1 if timeout is None else timeout
    started = time.monotonic()
    if owner == "thread":
        canceller = (threading.Thread(target=cancel_the_commits_wait, args=(dsn,))
                     if timeout is None else None)
        if canceller is not None:
            canceller.start()
        with pytest.raises(FenceNotDurableError, match="not known to be durable") as failure:
            locks.acquire_many(keys, timeout=seconds)
        if canceller is not None:
            canceller.join()
        nothing_held()
    else:
        async def main() -> pytest.ExceptionInfo[FenceNotDurableError]:
            canceller = (asyncio.create_task(asyncio.to_thread(cancel_the_commits_wait, dsn))
                         if timeout is None else None)
            with pytest.raises(FenceNotDurableError, match="not known to be durable") as failure:
                await locks.aio.acquire_many(keys, timeout=seconds)
            if canceller is not None:
                await canceller
            nothing_held()
            return failure

        failure = asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))
    assert time.monotonic() - started < (timeout or 0) + PATIENCE
    assert isinstance(failure.value, LockError)
    return str(failure.value)


def fence_row(dsn: str, locks: Manager, key: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT fence FROM public.lockmgr_fences WHERE key = %s",
                           (locks.advisory_key(key),)).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_fence_the_synchronous_standby_did_not_confirm_is_never_handed_out(
        fenced: Manager, dsn: str, standby: str, namespace: str, owner: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    handed_out = [take(fenced, ["k"], owner)["k"]]  # confirmed by the standby
    pgserver.stop(standby)
    # Each commit now waits for the standby: a timed call's and a try's wait is cancelled
    # at the deadline (the server then warns, and keeps the increment on the primary
    # alone); a wait without a timeout waits until another session cancels it.
    for keys, timeout in ((["k"], 0.5), (["k"], 0.0), (["k", "j"], 0.5), (["k"], None)):
        error = fails_holding_nothing(fenced, dsn, keys, timeout, owner)
        assert "PostgreSQL warned: " in error  # the server's warning, whatever its language
    # A deadline's cancel that the statement survived fails the call even with no warning
    # heard (a server, or a notice path, that does not send it).
    monkeypatch.setattr(_link, "_note_warning", lambda warned, notice: None)
    deaf: Manager = postgres.PgLockManager(dsn, namespace=namespace, fencing=True)
    try:
        error = fails_holding_nothing(deaf, dsn, ["k"], 0.5, owner)
        assert "the call's deadline cancelled the commit" in error
    finally:
        deaf.close()
    on_the_primary = fence_row(dsn, fenced, "k")
    assert on_the_primary == handed_out[-1] + 5  # five increments the standby never saw

    # The primary fails; the standby, promoted, has the confirmed increments only.
    pgserver.promote(standby)
    assert fence_row(standby, fenced, "k") == handed_out[-1]
    promoted: Manager = postgres.PgLockManager(standby, namespace=namespace, fencing=True)
    try:
        handed_out += [take(promoted, ["k"], owner)["k"], take(promoted, ["k", "j"], owner)["k"]]
    finally:
        promoted.close()
    assert handed_out == sorted(set(handed_out))  # never one twice
