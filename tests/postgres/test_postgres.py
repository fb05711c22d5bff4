"""The PostgreSQL backend against a real server, in-process and across processes."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import pgserver
from conftest import PATIENCE, abandoned_warnings, wait_until
from lockmgr import DeadlockError, LockError, LockLost, LockTimeout, NotOwnedError

import psycopg  # part of the [test] extra: missing, the suite fails rather than skips
from lockmgr import postgres
from lockmgr.postgres._engine import _PgEngine
from lockmgr.postgres._link import _Link, _poll
from lockmgr.postgres._session import _Session
from lockmgr.postgres._sql import _GRANTED_ADVISORY
from pg_support import (
    child, expect, finish, held_on_server, own_sessions_locks, race_timeouts_against_a_holder,
    run, terminate_holder, until, _waiting_on_server,
)

pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")


@pytest.fixture
def locks(engine, dsn, namespace) -> Iterator[postgres.PgLockManager[Any]]:  # type: ignore[no-untyped-def]
    manager: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    yield manager
    manager.release_all()
    manager.close()


# -- keys ------------------------------------------------------------------------------------


def test_advisory_keys_are_stable_and_typed() -> None:
    assert postgres.advisory_key("invoice:881", "billing") == postgres.advisory_key("invoice:881", "billing")
    assert postgres.advisory_key(1) == postgres.advisory_key(True)  # equal keys, one lock
    assert postgres.advisory_key("a", "x") != postgres.advisory_key("a", "y")
    assert postgres.advisory_key(("a", 1)) != postgres.advisory_key(("a1",))
    assert postgres.advisory_key(b"a") != postgres.advisory_key("a")
    # Stable across processes, versions and hosts: fixed values.
    assert postgres.advisory_key("invoice:881", "billing") == -2141838272319613357
    assert postgres.advisory_key(("user", 42)) == -690658361800815721
    for bad in (1.5, None, ["a"], frozenset()):
        with pytest.raises(TypeError):
            postgres.advisory_key(bad)


def test_an_int_key_of_any_length_has_one_advisory_key_whatever_the_digit_limit() -> None:
    """``sys.set_int_max_str_digits`` limits int to str conversions: a key must map to the
    same advisory key (and never raise) whatever limit the process set."""
    huge = 7 ** 9000  # 7,606 digits, over the default limit of 4,300
    previous = sys.get_int_max_str_digits()
    try:
        keys = []
        for limit in (0, 640, previous):
            sys.set_int_max_str_digits(limit)
            keys.append((postgres.advisory_key(huge), postgres.advisory_key(-huge)))
    finally:
        sys.set_int_max_str_digits(previous)
    assert keys[0] == keys[1] == keys[2] and keys[0][0] != keys[0][1]


def test_import_without_psycopg_says_what_to_install() -> None:
    code = "import sys; sys.modules['psycopg'] = None; import lockmgr.postgres"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "pip install 'lockmgr[postgres]'" in done.stderr


# -- one process -------------------------------------------------------------------------------


def test_acquire_release_reentrant_and_errors(locks, dsn) -> None:
    assert locks.acquire("k") is True and locks.acquire("k", timeout=0) is True
    assert locks.owned("k") and locks.recursion_count("k") == 2 and len(locks) == 1
    assert locks.locked("k") and held_on_server(dsn, locks, "k")
    locks.release("k")
    assert held_on_server(dsn, locks, "k")  # one PostgreSQL lock for all levels
    locks.release("k")
    assert not held_on_server(dsn, locks, "k") and not locks.locked("k")
    me = f"the calling thread {threading.current_thread().name!r} (ident {threading.get_ident()})"
    with pytest.raises(NotOwnedError, match=re.escape(f"key 'k' is not held by {me}")):
        locks.release("k")
    with pytest.raises(ValueError):
        locks.acquire("k", timeout=-2)
    with pytest.raises(TypeError):
        locks.acquire(1.5)
    with locks.hold("k", timeout=1) as entered, locks["j"]:
        assert entered and entered.keys == ("k",) and locks.owned("j")  # a Lease, truthy
    assert locks.release_all() == 0 and len(locks) == 0


def test_threads_of_one_process_take_turns(locks) -> None:
    counter = [0]

    def body() -> None:
        for _ in range(20):
            with locks.hold("shared"):
                value = counter[0]
                time.sleep(0)
                counter[0] = value + 1

    threads = [threading.Thread(target=body) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)
    assert counter[0] == 80


# -- across processes --------------------------------------------------------------------------


@pytest.mark.parametrize("pure", [False, True], ids=["children-compiled", "children-pure"])
def test_no_lost_update_across_processes(locks, dsn, namespace, pure) -> None:
    table = f"counter_{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (n int)")
        conn.execute(f"INSERT INTO {table} VALUES (0)")
    body = f"""
    import psycopg
    with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
        for _ in range(25):
            with locks.hold("counter"):
                n = conn.execute("SELECT n FROM {table}").fetchone()[0]
                time.sleep(0.001)
                conn.execute("UPDATE {table} SET n = %s", (n + 1,))
    say(done=True)
    """
    processes = [child(dsn, namespace, body, pure=pure) for _ in range(4)]
    for process in processes:
        expect(process, done=True)
        finish(process)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(f"SELECT n FROM {table}").fetchone()[0] == 100


def test_sets_in_opposite_orders_across_processes_never_deadlock(locks, dsn, namespace) -> None:
    body = """
    order = ["a", "b", "c"] if int(os.environ.get("FORWARD", "1")) else ["c", "b", "a"]
    for _ in range(30):
        with locks.hold_many(order, timeout=30):
            pass
    say(done=True)
    """
    forward = child(dsn, namespace, body)
    os.environ["FORWARD"] = "0"
    try:
        backward = child(dsn, namespace, body)
    finally:
        del os.environ["FORWARD"]
    for _ in range(30):
        with locks.hold_many(["b", "c", "a"], timeout=30):
            pass
    for process in (forward, backward):
        expect(process, done=True)
        finish(process)


def test_condition_works_on_a_key(locks) -> None:
    view = locks["k"]
    condition = threading.Condition(view)
    ready: list[int] = []

    def notify() -> None:
        with condition:
            ready.append(1)
            condition.notify()

    with condition:
        with condition:
            threading.Thread(target=notify).start()
            assert condition.wait_for(lambda: ready, timeout=PATIENCE)
            assert view._recursion_count() == 2
    assert not locks.owned("k") and len(locks) == 0


@pytest.mark.posix_only
def test_a_killed_holder_frees_its_keys_at_once(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, """
    locks.acquire("k")
    say(held=True)
    sys.stdin.readline()
    """)
    expect(holder, held=True)
    assert locks.acquire("k", timeout=0) is False
    holder.send_signal(signal.SIGKILL)
    holder.communicate(timeout=PATIENCE)
    started = time.monotonic()
    assert locks.acquire("k", timeout=PATIENCE) is True
    assert time.monotonic() - started < PATIENCE / 2
    locks.release("k")


@pytest.mark.posix_only
@pytest.mark.parametrize("waiter", ["thread", "task"])
def test_a_process_killed_while_it_waits_frees_what_it_holds(locks, dsn, namespace,
                                                           waiter) -> None:
    """PostgreSQL notices a waiting backend's client has gone only when it is granted,
    unless it checks the socket meanwhile (client_connection_check_interval, which every
    connection of the managers sets): "mine" must not wait for "k" to be released."""
    locks.acquire("k")
    waiting = child(dsn, namespace, """
    import asyncio
    async def main():
        await locks.aio.acquire("mine")
        say(holding=True)
        await locks.aio.acquire("k")
    if os.environ["WAITER"] == "task":
        asyncio.run(main())
    else:
        locks.acquire("mine")
        say(holding=True)
        locks.acquire("k")
    """, env={"WAITER": waiter})
    expect(waiting, holding=True)
    wait_until(lambda: _waiting_on_server(dsn) == 1, "the other process waits for k")
    waiting.send_signal(signal.SIGKILL)
    waiting.communicate(timeout=PATIENCE)
    wait_until(lambda: not held_on_server(dsn, locks, "mine"), "its session ended")
    assert _waiting_on_server(dsn) == 0
    locks.release("k")


def test_timeouts_across_processes_leave_nothing_held(locks, dsn, namespace) -> None:
    holder = child(dsn, namespace, """
    locks.acquire_many(["k", "b"])
    say(held=True)
    sys.stdin.readline()
    """)
    expect(holder, held=True)
    started = time.monotonic()
    assert locks.acquire("k", timeout=0.2) is False
    assert 0.2 <= time.monotonic() - started < 0.2 + PATIENCE / 4
    assert locks.acquire("k", blocking=False) is False
    assert locks.acquire_many(["a", "b"], timeout=0.2) is False  # all or nothing
    assert not held_on_server(dsn, locks, "a") and len(locks) == 0
    with pytest.raises(LockTimeout):
        with locks.hold("k", timeout=0.05):
            pytest.fail("entered without the key")
    finish(holder)
    assert locks.acquire_many(["a", "b", "k"], timeout=PATIENCE)
    locks.release_many(["a", "b", "k"])


def test_deadlock_between_processes_is_reported_and_undone(locks, dsn, namespace) -> None:
    locks.acquire("B")
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
    expect(other, holding="A")
    wait_until(lambda: _waiting_on_server(dsn) >= 1, "the other process waits for B")
    try:
        ours = locks.acquire("A", timeout=30)
        deadlocked_here = False
    except DeadlockError:
        ours, deadlocked_here = False, True
    if ours:
        locks.release("A")
    locks.release("B")
    theirs = json.loads(other.stdout.readline())  # type: ignore[union-attr]
    assert deadlocked_here != theirs["deadlock"], theirs  # exactly one side was refused
    finish(other)
    assert len(locks) == 0 and not held_on_server(dsn, locks, "A")


def test_shared_exclusive_and_upgrade_across_processes(engine, dsn, namespace) -> None:
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    reader = child(dsn, namespace, """
    locks.acquire_read("k")
    say(reading=True)
    sys.stdin.readline()
    locks.release_read("k")
    say(released=True)
    """, cls="PgRWLockManager")
    expect(reader, reading=True)
    assert rw.acquire_read("k", timeout=0) is True  # shared with the other process
    assert rw.acquire_write("k", timeout=0.2) is False  # the upgrade waits for the other reader
    assert rw.write_locked("k") is False
    reader.stdin.write("go\n")  # type: ignore[union-attr]
    reader.stdin.flush()  # type: ignore[union-attr]
    expect(reader, released=True)
    assert rw.acquire_write("k", timeout=PATIENCE) is True  # now the upgrade goes through
    assert rw.write_locked("k")
    rw.release_write("k")
    rw.release_read("k")
    with rw.hold_many(reads=["r"], writes=["w"], timeout=1):
        assert rw.write_locked("w") and not rw.write_locked("r")
    assert len(rw) == 0
    reader.communicate(timeout=PATIENCE)
    rw.close()


@pytest.mark.posix_only
def test_ctrl_c_cancels_the_server_side_wait(locks, dsn, namespace) -> None:
    locks.acquire("k")
    waiter = child(dsn, namespace, """
    import psycopg
    def interrupt():
        with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
            while not conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                   " AND NOT granted").fetchone()[0]:
                time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        locks.acquire("k")
        say(interrupted=False)
    except KeyboardInterrupt:
        with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
            waiting = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                   " AND NOT granted").fetchone()[0]
        say(interrupted=True, owned=locks.owned("k"), held=len(locks), waiting=waiting)
    """)
    expect(waiter, interrupted=True, owned=False, held=0, waiting=0)
    waiter.communicate(timeout=PATIENCE)
    assert waiter.returncode == 0
    locks.release("k")


def test_a_terminated_connection_is_a_lost_lock(engine, dsn, namespace) -> None:
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=lost.append)
    locks.acquire("k")
    locks.acquire("k")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
            " AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = %s::bigint",
            (locks.advisory_key("k"),))
    wait_until(lambda: "k" in locks.lost_keys(), "the manager noticed")
    assert lost == [["k"]]
    assert not held_on_server(dsn, locks, "k")  # PostgreSQL released it with the session
    assert not locks.owned("k") and len(locks) == 0
    for _ in range(2):  # each level's release says so
        with pytest.raises(LockLost):
            locks.release("k")
    with pytest.raises(NotOwnedError):
        locks.release("k")
    assert locks.lost_keys() == set() and lost == [["k"]]
    assert locks.acquire("k", timeout=1) is True  # a new session takes it again
    locks.release("k")
    locks.close()


def test_xact_lock_lives_and_dies_with_the_transaction(locks, dsn) -> None:
    conn = psycopg.connect(dsn)
    try:
        with psycopg.connect(dsn, autocommit=True) as outside, \
                pytest.raises(LockError, match="open transaction"):
            with locks.xact_lock(outside, "k"):
                pass
        other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=locks._namespace)
        with conn.transaction():
            with locks.xact_lock(conn, "k"):
                assert other.acquire("k", timeout=0) is False  # the same lock
            assert held_on_server(dsn, locks, "k")  # leaving the block does not release it
        assert not held_on_server(dsn, locks, "k")  # the commit did
        with pytest.raises(RuntimeError):
            with conn.transaction():
                with locks.xact_lock(conn, "k", shared=True, timeout=1):
                    raise RuntimeError("roll back")
        assert not held_on_server(dsn, locks, "k")  # so did the rollback
        other.acquire("k")
        with conn.transaction():
            with pytest.raises(LockTimeout):
                with locks.xact_lock(conn, "k", timeout=0.1):
                    pass
            with pytest.raises(LockTimeout):
                with locks.xact_lock(conn, "k", timeout=0):
                    pass
            assert conn.execute("SELECT 1").fetchone() == (1,)  # the transaction goes on
        other.release("k")
        other.close()
    finally:
        conn.close()


@pytest.mark.parametrize("timeout", [None, 0, 0.1], ids=["untimed", "try", "timed"])
def test_xact_lock_of_a_key_the_thread_holds_through_the_manager_is_refused_at_once(
        engine, dsn, namespace, timeout) -> None:
    """xact_lock runs on the caller's connection, another server session: a session lock
    the same thread holds in a conflicting mode would make it wait for itself for ever
    (or until its timeout). It raises DeadlockError at once, and the transaction goes on;
    a shared xact_lock beside a read is no conflict."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    conn = psycopg.connect(dsn)
    try:
        for take, release, shared, refused in [
                (rw.acquire_write, rw.release_write, False, True),
                (rw.acquire_write, rw.release_write, True, True),
                (rw.acquire_read, rw.release_read, False, True),
                (rw.acquire_read, rw.release_read, True, False)]:
            take("k")
            with conn.transaction():
                if refused:
                    with pytest.raises(DeadlockError, match="wait for .* itself"):
                        with rw.xact_lock(conn, "k", shared=shared, timeout=timeout):
                            pass
                    assert conn.execute("SELECT 1").fetchone() == (1,)
                else:
                    with rw.xact_lock(conn, "k", shared=shared, timeout=timeout):
                        pass
            release("k")
        with conn.transaction(), rw.xact_lock(conn, "k", timeout=timeout):
            pass  # nothing held through the manager: taken
    finally:
        conn.close()
        rw.close()


def test_xact_lock_records_name_their_transaction_and_mode(engine, dsn, namespace,
                                                           workers) -> None:
    """Only the transaction an xact_lock was taken in, and only a conflicting mode, make a
    session lock of the thread's refused: a later transaction on the same connection (a
    pool handing it on) is another holder to wait for, a shared lock beside a read is no
    conflict, and the records of ended transactions go."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    conn = psycopg.connect(dsn)
    try:
        with conn.transaction():
            with rw.xact_lock(conn, "k"):
                pass
        other = workers("other")
        took, done = threading.Event(), threading.Event()

        def hold_in_own_transaction() -> None:
            with conn.transaction(), rw.xact_lock(conn, "k"):
                took.set()
                assert done.wait(PATIENCE)

        holding = other.submit(hold_in_own_transaction)
        assert took.wait(PATIENCE)
        assert rw.acquire_write("k", timeout=0.2) is False  # waits for that other holder
        done.set()
        holding.result()
        with conn.transaction():
            with rw.xact_lock(conn, "r"):
                pass
        with conn.transaction():
            with rw.xact_lock(conn, "r", shared=True):
                pass
            assert rw.acquire_read("r", timeout=0) is True  # shared beside a read
            rw.release_read("r")
        for number in range(200):
            with conn.transaction(), rw.xact_lock(conn, number % 20):
                pass
        assert len(rw._local.xact_locks) == 1  # the last transaction's, gone at the next
    finally:
        conn.close()
        rw.close()


@pytest.mark.parametrize("timeout", [-1, 0, 0.1], ids=["untimed", "try", "timed"])
def test_a_session_lock_of_a_key_the_thread_took_with_xact_lock_is_refused_at_once(
        engine, dsn, namespace, timeout) -> None:
    """The other order: the thread took the key with xact_lock in a transaction still
    open; a session lock of it in a conflicting mode would wait for that transaction, and
    so for itself. DeadlockError at once; once the transaction ended, it is taken."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    conn = psycopg.connect(dsn)
    try:
        for shared, take, release, refused in [
                (False, rw.acquire_write, rw.release_write, True),
                (False, rw.acquire_read, rw.release_read, True),
                (True, rw.acquire_write, rw.release_write, True),
                (True, rw.acquire_read, rw.release_read, False)]:
            with conn.transaction():
                with rw.xact_lock(conn, "k", shared=shared):
                    pass
                if refused:
                    with pytest.raises(DeadlockError, match="wait for .* itself"):
                        take("k", timeout=timeout)
                    assert rw.acquire_many(writes=["j"], timeout=timeout)  # other keys go
                    rw.release_many(writes=["j"])
                else:
                    assert take("k", timeout=timeout)
                    release("k")
            assert take("k", timeout=timeout)  # committed: the xact lock went with it
            release("k")
        assert len(rw) == 0 and not held_on_server(dsn, rw, "k")
    finally:
        conn.close()
        rw.close()


@pytest.mark.parametrize("timeout", [-1, 0, 0.1], ids=["untimed", "try", "timed"])
def test_a_task_and_xact_lock_of_one_key_refuse_each_other_at_once(
        engine, dsn, namespace, timeout) -> None:
    """For a task, in both orders. xact_lock blocks the task's loop: a conflicting session
    lock of the task's would never be released. A session lock of a key the task took with
    xact_lock, in a transaction still open, would wait for itself, and so would its
    loop's thread's, called from the task. DeadlockError at once; another task is not
    refused (it waits while the first one commits)."""
    rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
    conn = psycopg.connect(dsn)

    async def another_task_takes_it() -> None:
        assert await rw.aio.acquire_write("k", timeout=PATIENCE)
        await rw.aio.release_write("k")

    async def main() -> None:
        assert await rw.aio.acquire_read("k")
        with conn.transaction():
            with pytest.raises(DeadlockError, match="calling task holds .* itself"):
                with rw.xact_lock(conn, "k", timeout=None if timeout < 0 else timeout):
                    pass
            with rw.xact_lock(conn, "k", shared=True):
                pass  # shared beside a read: no conflict
        await rw.aio.release_read("k")
        with conn.transaction():
            with rw.xact_lock(conn, "k"):
                pass
            with pytest.raises(DeadlockError, match="calling task holds .* xact_lock"):
                await rw.aio.acquire_read("k", timeout=timeout)
            with pytest.raises(DeadlockError, match="calling thread holds .* xact_lock"):
                rw.acquire_read("k", timeout=timeout)  # the loop's thread, from the task
            assert await rw.aio.acquire_write("j", timeout=timeout)  # other keys go
            await rw.aio.release_write("j")
            other = asyncio.create_task(another_task_takes_it())
            await until(lambda: _waiting_on_server(dsn) == 1, "the other task waits")
        await other  # committed: the other task got it
        assert await rw.aio.acquire_write("k", timeout=timeout)  # and so does this one
        await rw.aio.release_write("k")

    try:
        run(main)
        assert len(rw) == 0 and not held_on_server(dsn, rw, "k")
    finally:
        conn.close()
        rw.close()


def test_xact_lock_taken_in_a_task_refuses_its_threads_session_lock(
        engine, dsn, namespace) -> None:
    """In one thread, inside one transaction: a task (asyncio.run) takes "k" with
    xact_lock, and then the thread asks for "k" with a session lock, which would wait for
    its own transaction. DeadlockError at once, the task ended or not."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    conn = psycopg.connect(dsn)

    async def step() -> None:
        with locks.xact_lock(conn, "k"):
            pass

    try:
        with conn.transaction():
            asyncio.run(step())
            with pytest.raises(DeadlockError, match="calling thread holds .* xact_lock"):
                locks.acquire("k", timeout=PATIENCE)
        assert locks.acquire("k", timeout=0)  # committed: nothing in the way
        locks.release("k")
    finally:
        conn.close()
        locks.close()


def test_bench_adds_postgres_in_process_and_across_processes(dsn, tmp_path) -> None:
    from lockmgr import bench

    out = tmp_path / "pg.json"
    assert bench.main(["--quick", "--pg-dsn", dsn, "--scenario", "many-keys", "--threads", "2",
                       "--impl", "postgres", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {row["impl"] for row in rows} == {"postgres", "postgres-processes"}
    assert all(row["metric"] == "throughput" and row["value"] > 0 for row in rows)


def test_bench_server_pairs_beside_redis_py(dsn, tmp_path) -> None:
    """``--redis start`` runs Debian's redis-server (scripts/test-servers.sh installs it) for
    the run; lockmgr's pairs come with the bare psycopg and libpq loops' on the same server."""
    from lockmgr import bench

    pgserver.require_redis_server()
    out = tmp_path / "pairs.json"
    assert bench.main(["--quick", "--scenario", "server-pairs", "--pg-dsn", dsn, "--redis",
                       "start", "--threads", "2", "--json", str(out)]) == 0
    rows = {(row["impl"], row["metric"]): row["value"]
            for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {(impl, metric + measure)
                         for impl in ("postgres", "psycopg", "libpq", "redis-py")
                         for metric in ("1-process", "2-processes")
                         for measure in ("", " client CPU per pair")} | {
        ("postgres", "1-process vs redis-py"), ("postgres", "2-processes vs redis-py")}
    assert all(value > 0 for value in rows.values())
    assert bench.main(["--scenario", "server-pairs"]) == 2  # it needs a server to measure


REDIS_LOCKS = ("redis-py", "python-redis-lock", "pottery")


def test_bench_distributed_beside_redis_locks_and_tooz(dsn, tmp_path, capsys) -> None:
    """``--scenario distributed``: every implementation measured, and the safety facts of the
    README's table (fencing's included), asserted without timing thresholds (the machine is
    shared and noisy). On a
    free-threaded build, where psycopg2-binary and tooz cannot be installed, the answer is
    "needs lockmgr[compare]"."""
    from lockmgr import bench
    from lockmgr.bench import _cli

    pgserver.require_redis_server()
    out = tmp_path / "distributed.json"
    argv = ["--quick", "--scenario", "distributed", "--pg-dsn", dsn, "--redis", "start",
            "--threads", "2", "--json", str(out)]
    if any(importlib.util.find_spec(module) is None for module in _cli.COMPARE_MODULES):
        assert bench.main(argv) == 2
        assert "needs lockmgr[compare]" in capsys.readouterr().err
        assert not out.exists()
        return
    assert bench.main(argv) == 0
    rows = {(row["impl"], row["metric"]): row["value"]
            for row in json.loads(out.read_text())["results"]}
    for impl in ("lockmgr", "lockmgr fenced", *REDIS_LOCKS, "redis-py 1ms", "tooz"):
        assert rows[impl, "pairs, 2 processes with a key each"] > 0
        assert rows[impl, "pairs, 2 processes on 1 key"] > 0
        assert 0 < rows[impl, "hand-off p50"] <= rows[impl, "hand-off p99"]
    for impl in ("lockmgr", *REDIS_LOCKS, "tooz"):
        assert rows[impl, "killed holder: key free after"] > 0
    # A paused holder: lockmgr's session lock outlives the pause, no second holder gets in;
    # a Redis lock's lease runs out under it (by design), so a second holder writes first.
    assert rows["lockmgr", "paused holder: a 2nd holder got in"] == 0
    assert rows["lockmgr", "paused holder: overlap"] == 0
    assert rows["lockmgr", "paused holder: its stale write accepted"] == 0
    assert rows["lockmgr", "paused holder: its release failed"] == 0
    # With fencing=True and its session ended during the pause (as a failover would), a second
    # holder does get in; the fence keeps the first one's late write out.
    assert rows["lockmgr fenced", "paused holder: a 2nd holder got in"] == 1
    assert rows["lockmgr fenced", "paused holder: its stale write accepted"] == 0
    assert rows["lockmgr fenced", "paused holder: its release failed"] == 1
    overlapped = [impl for impl in REDIS_LOCKS if rows[impl, "paused holder: overlap"] > 0]
    assert overlapped
    assert all(rows[impl, "paused holder: its stale write accepted"] == 1 for impl in overlapped)
    # Two names tooz maps to one of its 65,536 keys wait for each other there, not in lockmgr.
    assert rows["tooz", "a tooz-colliding pair excluded each other"] == 1
    assert rows["lockmgr", "a tooz-colliding pair excluded each other"] == 0
    assert rows["lockmgr", "lock keys of 100,000 names"] == 100_000
    assert rows["tooz", "lock keys of 100,000 names"] <= 65_536
    assert bench.main(["--scenario", "distributed", "--pg-dsn", dsn]) == 2  # needs --redis


# -- issue 12: every promise kept under timeouts, forks, dead connections, cancels, Ctrl-C ------


@pytest.mark.posix_only
def test_timeouts_racing_grants_never_leave_a_lock_held(locks, dsn, namespace) -> None:
    """A timeout can fire just as the key is granted (PostgreSQL then reports the timeout
    and grants all the same): whatever the race, a call that says False holds nothing."""
    other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)

    def attempt(number: int, timeout: float) -> bool:
        keys = ["k", "j"] if number % 2 else ["k"]
        got = locks.acquire_many(keys, timeout=timeout)
        if got:
            locks.release_many(keys)
        return got

    race_timeouts_against_a_holder(lambda: other.hold("k", timeout=PATIENCE), attempt)
    assert own_sessions_locks(dsn) == 0 and len(locks) == 0
    other.close()


FORKED = """
import multiprocessing, traceback
import psycopg
table = os.environ["TABLE"]

def work(rounds):
    with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
        for _ in range(rounds):
            with locks.hold("x"):
                n = conn.execute(f"SELECT n FROM {table}").fetchone()[0]
                time.sleep(0.002)
                conn.execute(f"UPDATE {table} SET n = %s", (n + 1,))
    return True

locks.acquire("warm")  # preloaded: locked once at start-up, so an idle connection is inherited
locks.release("warm")
pids = []
for _ in range(2):
    pid = os.fork()
    if pid == 0:
        try:
            work(15)
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)  # a normal exit: the child's managers close what they own, nothing more
    pids.append(pid)
with multiprocessing.get_context("fork").Pool(2) as pool:
    assert pool.map(work, [15, 15]) == [True, True]
statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
work(15)  # the parent's inherited-by-everyone connection still works for the parent
say(statuses=statuses)
"""


@pytest.mark.posix_only
def test_forked_workers_never_share_a_session_or_a_key(engine, dsn, namespace) -> None:
    table = f"counter_{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (n int)")
        conn.execute(f"INSERT INTO {table} VALUES (0)")
    os.environ["TABLE"] = table
    try:
        parent = child(dsn, namespace, FORKED, pure=engine.__name__.endswith("_pure"))
    finally:
        del os.environ["TABLE"]
    expect(parent, statuses=[0, 0])
    finish(parent)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert conn.execute(f"SELECT n FROM {table}").fetchone()[0] == 75  # no lost update


@pytest.mark.posix_only
def test_a_forked_child_never_frees_its_parents_locks(engine, dsn, namespace) -> None:
    parent = child(dsn, namespace, """
    locks.acquire("k")
    pid = os.fork()
    if pid == 0:
        try:
            locks.release("k")  # the parent's lock, not the child's
            code = 2
        except LockLost:
            code = 0 if not locks.owned("k") and locks.acquire("k", timeout=0) is False else 3
        sys.exit(code)  # a normal exit runs the child's clean-up
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    say(child=code, owned=locks.owned("k"))
    sys.stdin.readline()
    locks.release("k")
    """, pure=engine.__name__.endswith("_pure"))
    expect(parent, child=0, owned=True)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    assert held_on_server(dsn, locks, "k") and locks.acquire("k", timeout=0) is False
    finish(parent)
    assert locks.acquire("k", timeout=PATIENCE)
    locks.release("k")
    locks.close()


AT_FORK_FIRST = """
import json, os, sys
made = {}

def in_the_child():  # an application's at-fork handler, registered before lockmgr's
    if "locks" in made:
        made["locks"].acquire("child-key")
        made["backend"] = made["locks"]._session().link.backend

os.register_at_fork(after_in_child=in_the_child)
from lockmgr import postgres

locks = made["locks"] = postgres.PgLockManager(os.environ["DSN"], namespace=os.environ["NAMESPACE"])
locks.acquire("k")
parent = locks._session().link.backend
locks.release("k")  # the thread keeps its connection for its next call
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, json.dumps(made.get("backend")).encode())
    os._exit(0)
os.close(write)
child = json.loads(os.read(read, 100))
os.waitpid(pid, 0)
print(json.dumps({"parent": parent, "child": child}))
"""


@pytest.mark.posix_only
def test_a_forked_childs_first_handler_never_speaks_on_its_parents_connection(
        engine, dsn, namespace) -> None:
    """An application's at-fork handler registered before lockmgr's runs first in the
    child: a lock it takes goes on a connection of the child's own, never on the one the
    parent's thread keeps (the parent's session would hold it, and nobody release it).
    Both engines set the child up for that call (the compiled core has no mutex held across
    fork; the pure twin, which holds its own, sets the child up at that call)."""
    env = {**os.environ, "DSN": dsn, "NAMESPACE": namespace,
           "LOCKMGR_NO_EXTENSIONS": "1" if engine.__name__.endswith("_pure") else ""}
    done = subprocess.run([sys.executable, "-c", AT_FORK_FIRST], capture_output=True, text=True,
                          env=env, timeout=PATIENCE * 3)
    assert done.returncode == 0, done.stderr
    backends = json.loads(done.stdout.splitlines()[-1])
    assert backends["child"] is not None and backends["child"] != backends["parent"]
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    wait_until(lambda: not held_on_server(dsn, locks, "child-key"), "the child's session ended")
    locks.close()


@pytest.mark.parametrize("how", ["pg_terminate_backend", "server restart"])
def test_a_dead_connection_never_locks_a_thread_out(engine, dsn, namespace, how) -> None:
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(
        dsn, namespace=namespace, on_lost=lost.append)
    locks.acquire("idle")
    locks.release("idle")  # its connection is now idle, in the manager's list
    holder_done = threading.Event()

    def hold_until_told() -> None:
        locks.acquire("a")
        holder_done.wait(PATIENCE)
        try:
            locks.release("a")
        except LockLost:
            lost.append(["released"])

    holder = threading.Thread(target=hold_until_told)
    holder.start()
    wait_until(lambda: held_on_server(dsn, locks, "a"), "the holder holds a")
    if how == "server restart":
        pgserver.restart(dsn)
    else:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid, %s) FROM pg_stat_activity"
                          " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
                          (int(PATIENCE * 1000),))
    for _ in range(3):  # the idle connection is replaced, then reused
        assert locks.acquire("k", timeout=PATIENCE) is True
        assert held_on_server(dsn, locks, "k")
        locks.release("k")
    holder_done.set()
    holder.join(PATIENCE)
    assert lost == [["a"], ["released"]]  # told once, then at the release
    assert locks.acquire("a", timeout=PATIENCE) is True
    locks.release("a")
    locks.close()


@pytest.mark.parametrize("timeout", [-1, 30], ids=["no-timeout", "timeout"])
def test_a_cancelled_statement_during_a_set_leaves_nothing_held(engine, dsn, namespace,
                                                                  timeout, workers) -> None:
    holder: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    first, second = sorted(["a", "b"], key=holder.advisory_key)  # the set takes first first
    holder.acquire(second)
    # (a statement_timeout of the role's, the database's or the DSN's is pinned to 0)
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    waiter = workers("waiter")
    call = waiter.submit(lambda: locks.acquire_many([first, second], timeout=timeout))
    wait_until(lambda: _waiting_on_server(dsn) == 1, "the set waits on the server")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_cancel_backend(pid) FROM pg_locks"
                      " WHERE locktype = 'advisory' AND NOT granted")
    with pytest.raises(psycopg.errors.QueryCanceled):
        call.result()
    assert not held_on_server(dsn, holder, first) and len(locks) == 0
    holder.release(second)
    assert waiter.run(lambda: locks.acquire_many([first, second], timeout=PATIENCE)) is True
    waiter.run(lambda: locks.release_many([first, second]))
    for manager in (holder, locks):
        manager.close()


def test_an_interrupt_just_after_a_timed_out_call_gave_its_keys_back(locks, dsn,
                                                                      namespace) -> None:
    """Ctrl-C landing right after a timed-out acquisition gave its keys back in-process (a
    handler can raise at the check that follows any call) ends the call there: nothing is
    given back twice, so an outer level of a key the thread held before stays held."""
    holder: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holder.acquire("j")
    locks.acquire("k")
    engine = locks._engine

    class InterruptedAfterRelease:
        def __getattr__(self, name: str) -> Any:
            return getattr(engine, name)

        def release_many(self, keys: list[object]) -> None:
            engine.release_many(keys)
            locks._engine = engine  # once
            raise KeyboardInterrupt

    locks._engine = InterruptedAfterRelease()
    with pytest.raises(KeyboardInterrupt):  # not NotOwnedError from a second release
        locks.acquire_many(["k", "j"], timeout=0)  # j: held by the holder
    assert locks._engine is engine
    assert locks.owned("k") and locks.recursion_count("k") == 1 and not locks.owned("j")
    assert held_on_server(dsn, locks, "k") and len(locks) == 1
    locks.release("k")
    assert not held_on_server(dsn, locks, "k") and len(locks) == 0
    holder.release("j")
    holder.close()


def test_ctrl_c_before_a_release_reaches_the_server_leaves_nothing_held(locks, dsn,
                                                                         monkeypatch) -> None:
    """Ctrl-C landing at the first check point of a release's round trip (the release is
    counted as done): the key is given back on the server by the thread's next call."""
    unlock = _PgEngine._unlock

    def interrupted(*args: Any) -> None:
        monkeypatch.setattr(_PgEngine, "_unlock", unlock)  # once
        raise KeyboardInterrupt

    locks.acquire("k")
    monkeypatch.setattr(_PgEngine, "_unlock", interrupted)
    with pytest.raises(KeyboardInterrupt):
        locks.release("k")
    assert not locks.owned("k") and len(locks) == 0
    assert locks.lost_keys() == set()  # a call of the thread's: it settles what was left
    assert not held_on_server(dsn, locks, "k")
    assert locks.acquire("k", timeout=0) is True
    locks.release("k")
    assert not held_on_server(dsn, locks, "k")


def test_ctrl_c_twice_in_a_failed_acquire_leaves_nothing_held(locks, dsn, monkeypatch) -> None:
    """Ctrl-C right after the server granted the key, then again at the first check point of
    the clean-up that gives it back: the thread's next call gives it back."""
    lock, drop = _PgEngine._lock, _PgEngine._drop_or_lose

    def granted_then_interrupted(*args: Any) -> bool:
        monkeypatch.setattr(_PgEngine, "_lock", lock)  # once
        assert lock(*args) is True
        raise KeyboardInterrupt

    def interrupted(*args: Any) -> None:
        monkeypatch.setattr(_PgEngine, "_drop_or_lose", drop)  # once
        raise KeyboardInterrupt

    monkeypatch.setattr(_PgEngine, "_lock", granted_then_interrupted)
    monkeypatch.setattr(_PgEngine, "_drop_or_lose", interrupted)
    with pytest.raises(KeyboardInterrupt):
        locks.acquire_many(["k", "j"])
    assert not locks.owned("k") and not locks.owned("j") and len(locks) == 0
    assert locks.lost_keys() == set()  # a call of the thread's: it settles what was left
    assert not held_on_server(dsn, locks, "k") and not held_on_server(dsn, locks, "j")
    assert locks.acquire_many(["k", "j"], timeout=0) is True
    locks.release_many(["k", "j"])


CTRL_C_STORM = """
import random, signal
import psycopg
other = postgres.PgLockManager(os.environ["DSN"], namespace=os.environ["NAMESPACE"])
stop, storming = threading.Event(), threading.Event()
failures = []

def hammer():
    rng = random.Random(3)
    try:
        while not stop.is_set():
            with other.hold("k", timeout=30):
                time.sleep(rng.random() * 0.002)
    except BaseException as error:  # a leaked lock would starve it
        failures.append(repr(error))

gap, repeated = float(os.environ["STORM_GAP"]), bool(os.environ["STORM_REPEATED"])

def storm():
    rng = random.Random(7)
    while storming.is_set():
        time.sleep(rng.random() * gap)
        os.kill(os.getpid(), signal.SIGINT)

# Ctrl-C's KeyboardInterrupt, raised wherever the main thread is inside the calls under
# test (not in this script's own loop, where nothing could catch it); repeated: as often
# as it comes, into the clean-up of an interrupted call too.
calling = [False]

def interrupt(signum, frame):
    if calling[0]:
        calling[0] = repeated
        raise KeyboardInterrupt

signal.signal(signal.SIGINT, interrupt)

hammer_thread = threading.Thread(target=hammer)
hammer_thread.start()
if repeated:  # held throughout: a connection closed by a failed clean-up loses it
    locks.acquire("base")
storming.set()
storm_thread = threading.Thread(target=storm)
storm_thread.start()
seen = {"KeyboardInterrupt": 0, "LockLost": 0, "acquired": 0, "timed out": 0}
rng = random.Random(1)
end = time.monotonic() + 3
while time.monotonic() < end:
    try:
        calling[0] = True
        choice = rng.random()
        if choice < 0.3:
            got, keys = locks.acquire("k"), ["k"]
        elif choice < 0.6:
            got, keys = locks.acquire("k", timeout=0.003), ["k"]
        else:
            got, keys = locks.acquire_many(["k", "j"], timeout=0.003), ["k", "j"]
        if got:
            locks.release_many(keys)
        calling[0] = False
        seen["acquired" if got else "timed out"] += 1
    except KeyboardInterrupt:
        calling[0] = False
        seen["KeyboardInterrupt"] += 1
    except LockLost:
        calling[0] = False
        seen["LockLost"] += 1
    except BaseException as error:
        calling[0] = False
        failures.append(repr(error))
calling[0] = False
storming.clear()
storm_thread.join()
base = "held" if locks.owned("base") else "lost" if "base" in locks.lost_keys() else "no"
try:
    locks.release_all()  # what the manager believes this thread holds
except LockLost:
    pass
stop.set()
hammer_thread.join()
other.close()
locks.close()
with psycopg.connect(os.environ["DSN"], autocommit=True) as conn:
    left = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'").fetchone()[0]
say(failures=failures, left=left, seen=seen, base=base)
"""


class InterruptedAsItReturns:
    """An in-process engine whose acquisitions are interrupted right after they return (a
    Ctrl-C at the check CPython makes after a call)."""

    ACQUISITIONS = ("acquire", "acquire_read", "acquire_write", "acquire_many")

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.engine, name)
        if name not in self.ACQUISITIONS:
            return method

        def interrupted(*args: Any, **kwargs: Any) -> bool:
            method(*args, **kwargs)
            raise KeyboardInterrupt
        return interrupted


@pytest.mark.parametrize("manager", ["PgLockManager", "PgRWLockManager"])
@pytest.mark.parametrize("timeout", [-1, 0, 5], ids=["untimed", "try", "timed"])
def test_ctrl_c_as_the_in_process_acquisition_returns_leaves_nothing_held(
        engine, dsn, namespace, workers, manager, timeout) -> None:
    """The interrupt takes the acquisition's result, not the acquisition: it goes back, so
    no thread keeps a key in process that the server never gave it."""
    locks: Any = getattr(postgres, manager)(dsn, namespace=namespace)
    real = locks._engine
    locks._engine = InterruptedAsItReturns(real)
    take = locks.acquire if manager == "PgLockManager" else locks.acquire_write
    with pytest.raises(KeyboardInterrupt):
        take("k", timeout=timeout)
    with pytest.raises(KeyboardInterrupt):
        locks.acquire_many(["k", "j"], timeout=timeout)
    locks._engine = real
    assert len(locks) == 0 and locks.lost_keys() == set()
    other = workers("other")
    assert other.run(lambda: take("k", timeout=PATIENCE)) is True  # in process and on the server
    other.run(lambda: locks.release("k") if manager == "PgLockManager"
              else locks.release_write("k"))
    assert take("k", timeout=0) is True
    locks.release_all()
    locks.close()


def test_ctrl_c_at_a_releases_count_down_leaves_no_level_without_its_lock(
        engine, dsn, namespace, monkeypatch) -> None:
    """A Ctrl-C at the count-down's entry, once the server released the keys: the thread
    must not keep levels that its next acquisition would take as a re-entry (no server
    lock: a second holder could come in). The in-process release still happens, and the
    next call finishes the count-down."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    given = _Session.given
    fired: list[bool] = []

    def interrupted_at_entry(session: Any, items: Any) -> Any:
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return given(session, items)

    locks.acquire_many(["k", "j"])
    monkeypatch.setattr(_Session, "given", interrupted_at_entry)
    with pytest.raises(KeyboardInterrupt):
        locks.release_many(["k", "j"])
    monkeypatch.undo()
    assert locks.lost_keys() == set() and len(locks) == 0
    assert locks.acquire("k", timeout=0) is True and held_on_server(dsn, locks, "k")
    assert other.acquire("k", timeout=0) is False  # one holder
    locks.release("k")
    assert locks.recursion_count("k") == 0 and not held_on_server(dsn, locks, "k")
    locks.close()
    other.close()


def test_a_poll_that_returned_with_a_handlers_exception_set_raises_that_exception() -> None:
    """CPython 3.13t (GIL off) can turn a Ctrl-C landing as poll() returns into SystemError
    "... returned a result with an exception set", the KeyboardInterrupt as its cause: the
    backend raises the KeyboardInterrupt itself, which its clean-ups expect; any other
    SystemError stays what it is."""
    class Poller:
        def __init__(self, error: BaseException) -> None:
            self.error = error

        def poll(self, milliseconds: float) -> list[tuple[int, int]]:
            raise self.error

    wrapped = SystemError("<method 'poll' of 'select.poll' objects> returned a result with"
                          " an exception set")
    wrapped.__cause__ = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt) as raised:
        _poll(Poller(wrapped), 0)
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    other = SystemError("something else")
    with pytest.raises(SystemError) as kept:
        _poll(Poller(other), 0)
    assert kept.value is other


@pytest.mark.parametrize("first", ["read", "counted"])
@pytest.mark.parametrize("call", ["untimed", "timed", "try", "many"])
def test_ctrl_c_after_the_grant_then_at_the_clean_ups_entry_leaves_nothing_held(
        engine, dsn, namespace, monkeypatch, call, first) -> None:
    """A first Ctrl-C lands once the server's grant has been read (or counted), a second
    one at the clean-up's first check point (undo_take's entry). The keys the server
    granted must be on record (``unsure``) from before the round trip, and the counts as
    they were (``taking``), so the thread's next call releases them; the in-process
    acquisition goes back too."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    fired: set[str] = set()
    round_trip, undo_take = _Link._round_trip, _Session.undo_take
    granted = _Session.granted

    def interrupted_after_the_grant(link: Any, deadline: Any, send: Any, *args: Any) -> Any:
        results = round_trip(link, deadline, send, *args)
        statement = bytes(args[0])
        locking = any(name in statement for name in (b"pg_advisory_lock", b"pg_try_advisory",
                                                     b"pg_advisory_xact_lock"))
        if "grant" not in fired and send.__name__ != "send_prepare" and locking:
            fired.add("grant")
            raise KeyboardInterrupt
        return results

    def interrupted_once_counted(session: Any, *args: Any) -> None:
        granted(session, *args)
        fired.add("grant")
        raise KeyboardInterrupt

    def interrupted_at_entry(session: Any, *args: Any) -> None:
        if "undo" not in fired:
            fired.add("undo")
            raise KeyboardInterrupt
        undo_take(session, *args)

    take = {"untimed": lambda: locks.acquire("k"), "timed": lambda: locks.acquire("k", timeout=PATIENCE),
            "try": lambda: locks.acquire("k", timeout=0),
            "many": lambda: locks.acquire_many(["k", "j"], timeout=PATIENCE)}[call]
    if first == "read":
        monkeypatch.setattr(_Link, "_round_trip", interrupted_after_the_grant)
    else:
        monkeypatch.setattr(_Session, "granted", interrupted_once_counted)
    monkeypatch.setattr(_Session, "undo_take", interrupted_at_entry)
    with pytest.raises(KeyboardInterrupt):
        take()
    assert fired == {"grant", "undo"}
    monkeypatch.undo()
    assert locks.lost_keys() == set()  # the next call settles
    assert not locks.owned("k") and len(locks) == 0 and locks.recursion_count("k") == 0
    assert other.acquire_many(["k", "j"], timeout=0) is True  # nothing held on the server
    other.release_many(["k", "j"])
    assert locks.acquire("k", timeout=0) is True
    locks.release("k")
    locks.close()
    other.close()


@pytest.mark.posix_only
@pytest.mark.parametrize("repeated", [False, True], ids=["once-per-call", "repeated"])
def test_ctrl_c_storms_leave_nothing_held(engine, dsn, namespace, repeated) -> None:
    """SIGINT every few milliseconds at a thread acquiring a contended key: every call ends
    in its result or KeyboardInterrupt (LockLost where a connection had to be closed), and
    nothing the manager does not know of is left held on the server. Repeated interrupts
    also land in the clean-up of interrupted calls, which then closes the connection: a key
    held on it is lost, never left held."""
    os.environ["STORM_GAP"], os.environ["STORM_REPEATED"] = ("0.01", "1") if repeated else ("0.02", "")
    try:
        storm = child(dsn, namespace, CTRL_C_STORM, pure=engine.__name__.endswith("_pure"))
    finally:
        del os.environ["STORM_GAP"], os.environ["STORM_REPEATED"]
    said = expect(storm, failures=[], left=0)
    finish(storm)
    assert said["seen"]["KeyboardInterrupt"] >= 10, said
    if repeated:
        assert said["base"] in ("held", "lost"), said
    else:
        assert said["seen"]["acquired"] >= 5 and said["base"] == "no", said


@pytest.mark.parametrize("then", ["release", "release_all"])
def test_an_interrupt_halfway_through_losing_a_connection_loses_its_keys_all_the_same(
        locks, dsn, monkeypatch, then) -> None:
    """Found by the storm above on a free-threaded build: KeyboardInterrupt landing after
    the dead connection was taken from the session but before its keys were moved to
    ``lost`` left keys counted on no connection, and the next release failed an assertion
    (the storm's ``release_all``). The owner's next call finishes the loss instead."""
    locks.acquire("k")
    locks.acquire("j")
    terminate_holder(dsn, locks, "k")
    real_lose_levels = _Session.lose_levels

    def interrupted(session: _Session) -> None:
        monkeypatch.setattr(_Session, "lose_levels", real_lose_levels)
        raise KeyboardInterrupt  # where a signal handler's may land

    monkeypatch.setattr(_Session, "lose_levels", interrupted)
    with pytest.raises(KeyboardInterrupt):
        locks.release("k")  # finds the connection dead
    assert not locks.owned("k") and locks.owned("j") is False  # j: its connection is gone
    with pytest.raises(LockLost, match="'j'"):
        if then == "release":
            locks.release("j")
        else:
            locks.release_all()
    assert len(locks) == 0 and locks.lost_keys() == set()
    assert not held_on_server(dsn, locks, "j")
    assert locks.acquire("j", timeout=PATIENCE)  # a new connection takes it again
    locks.release("j")


@pytest.mark.posix_only
def test_more_than_1024_open_files(engine, dsn, namespace) -> None:
    process = child(dsn, namespace, """
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    spare = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    locks.acquire("k")  # its connection's socket is above 1024
    locks.acquire("k")  # a nested acquire checks the connection
    lost = sorted(locks.lost_keys())
    locks.release("k")
    locks.release("k")
    say(lost=lost, highest=max(spare) > 1024)
    """, pure=engine.__name__.endswith("_pure"))
    expect(process, lost=[], highest=True)
    finish(process)


def test_a_loss_is_told_at_every_release_and_never_again(engine, dsn, namespace) -> None:
    lost: list[list[object]] = []
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace,
                                                                on_lost=lost.append)
    locks.acquire("a")
    locks.acquire("a")
    with psycopg.connect(dsn, autocommit=True) as admin:
        pid = admin.execute(f"SELECT pid FROM {_GRANTED_ADVISORY} %s",
                            (locks.advisory_key("a"),)).fetchone()[0]
    terminate_holder(dsn, locks, "a")
    with pytest.raises(LockLost):  # the inner release notices (no lost_keys() asked first)
        locks.release("a")
    assert lost == [["a"]]
    assert not locks.owned("a") and locks.recursion_count("a") == 0 and "a" not in locks
    assert locks.owner("a") is None and len(locks) == 0 and locks.lost_keys() == {"a"}
    with pytest.raises(LockLost):  # the lost key itself cannot be taken again yet
        locks.acquire("a", timeout=0)
    assert locks.acquire("b", timeout=PATIENCE) is True  # an unrelated key: a new session
    assert locks.owned("b") and "b" in locks and lost == [["a"]]
    with pytest.raises(LockLost):  # the outer release says so too
        locks.release("a")
    with pytest.raises(NotOwnedError):
        locks.release("a")
    assert locks.lost_keys() == set() and lost == [["a"]]
    assert locks.acquire("a", timeout=PATIENCE) is True
    locks.release_many(["a", "b"])
    with psycopg.connect(dsn, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                             (pid,)).fetchone()[0] == 0
    locks.close()


def test_huge_timeouts_are_accepted_like_threading(locks, dsn, namespace, workers) -> None:
    huge = threading.TIMEOUT_MAX
    assert threading.Lock().acquire(timeout=huge)  # what threading accepts
    assert locks.acquire("k", timeout=huge) is True
    assert locks.acquire_many(["a", "b"], timeout=huge) is True
    locks.release_many(["a", "b", "k"])
    holder: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holder.acquire("c")
    waiter = workers("waiter")
    call = waiter.submit(lambda: locks.acquire("c", timeout=huge))
    wait_until(lambda: _waiting_on_server(dsn) == 1, "the waiter waits on the server")
    holder.release("c")
    assert call.result() is True
    waiter.run(lambda: locks.release("c"))
    with psycopg.connect(dsn) as conn:
        with conn.transaction(), locks.xact_lock(conn, "d", timeout=huge):
            assert held_on_server(dsn, locks, "d")
    holder.close()


def test_locked_asks_about_this_database_only(locks, engine, dsn, namespace) -> None:
    other_db = f"other_{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {other_db}")
    try:
        with psycopg.connect(dsn.rsplit("/", 1)[0] + "/" + other_db, autocommit=True) as there:
            there.execute("SELECT pg_advisory_lock(%s)", (locks.advisory_key("k"),))
            assert locks.locked("k") is False  # another database's lock, not this one
            rw: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(dsn, namespace=namespace)
            assert rw.write_locked("k") is False
            assert locks.acquire("k", timeout=0) is True and locks.locked("k") is True
            locks.release("k")
            rw.close()
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {other_db}")


def holders_backend(dsn: str, locks: Any, key: object) -> int:
    """The server pid of the session holding ``key``, asked on a connection of the test's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT pid FROM {_GRANTED_ADVISORY} %s",
                           (locks.advisory_key(key),)).fetchone()
    assert row is not None, f"{key!r} is not held"
    return int(row[0])


def test_threads_taking_turns_share_one_connection(engine, dsn, namespace) -> None:
    """A thread that holds nothing keeps its connection for its next call, but gives it to
    any other thread that needs one, and to the next thread when it ends: threads taking
    turns, ended or still alive, never open a second connection."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    backends: list[int] = []

    def hold_once() -> None:
        with locks.hold("k"):
            backends.append(holders_backend(dsn, locks, "k"))

    hold_once()
    hold_once()  # kept
    ended = threading.Thread(target=hold_once)  # takes the main thread's, and leaves it idle
    ended.start()
    ended.join(PATIENCE)
    hold_once()
    done, go_on = threading.Event(), threading.Event()

    def hold_and_stay() -> None:
        hold_once()
        done.set()
        go_on.wait(PATIENCE)

    alive = threading.Thread(target=hold_and_stay)
    alive.start()
    assert done.wait(PATIENCE)
    hold_once()  # the living thread's, which holds nothing
    go_on.set()
    alive.join(PATIENCE)
    assert len(backends) == 6 and len(set(backends)) == 1, backends
    locks.close()


def test_close_closes_the_connection_a_thread_keeps(engine, dsn, namespace) -> None:
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    with locks.hold("k"):
        backend = holders_backend(dsn, locks, "k")
    locks.close()

    def gone() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s",
                               (backend,)).fetchone()
        return bool(row) and row[0] == 0

    wait_until(gone, "the server session ended")
    assert locks.acquire("k", timeout=PATIENCE)  # and the thread takes a new one
    locks.release("k")
    locks.close()


def test_threads_that_end_leave_nothing_behind(engine, dsn, namespace) -> None:
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    ended = threading.Thread(target=locks.acquire, args=("k",))
    with abandoned_warnings() as warned:  # started inside: see conftest.abandoned_warnings
        ended.start()
        ended.join(PATIENCE)
    assert warned, "no AbandonedLockWarning for the thread that ended holding k"
    # its session ended with it, so PostgreSQL released its key
    wait_until(lambda: not held_on_server(dsn, locks, "k"), "the server released k")
    assert locks.acquire("k", timeout=PATIENCE) is True
    locks.release("k")

    def lose_and_end() -> None:
        locks.acquire("j")
        terminate_holder(dsn, locks, "j")
        wait_until(lambda: "j" in locks.lost_keys(), "the manager noticed")

    with abandoned_warnings() as warned:
        lost_thread = threading.Thread(target=lose_and_end)
        lost_thread.start()
        lost_thread.join(PATIENCE)
    assert warned, "no AbandonedLockWarning for the thread that ended holding j"
    assert locks.lost_keys() == set() and len(locks) == 0  # the dead thread's loss is gone
    assert not locks._sessions  # and so is its session
    locks.close()


def test_seeing_contention_between_this_process_threads(engine, dsn, namespace) -> None:
    """log_waits_after, snapshot() and metrics() of a PostgreSQL manager are those of its
    in-process engine: this process's threads waiting for each other."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("lockmgr")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    manager: postgres.PgRWLockManager[Any] = postgres.PgRWLockManager(
        dsn, namespace=namespace, log_waits_after=0.01)
    try:
        assert manager.log_waits_after == 0.01
        manager.acquire_write("k")
        waiter = threading.Thread(target=lambda: (manager.acquire_read("k"),
                                                  manager.release_read("k")))
        waiter.start()
        wait_until(lambda: manager.stats().waiting == 1, "the other thread queued")
        (state,) = manager.snapshot()
        assert state.key == "k" and state.holders[0].owner == threading.get_ident()
        assert [(w.owner, w.mode) for w in state.waiters] == [(waiter.ident, "read")]
        wait_until(lambda: records, "the slow-wait warning")
        manager.release_write("k")
        waiter.join(PATIENCE)
        assert manager.metrics().contended == manager.metrics().wait_time.count == 1
        assert [record.levelname for record in records] == ["WARNING", "INFO"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        manager.release_all()
        manager.close()


def test_a_missing_server_binary_skips_naming_it_or_fails_where_servers_are_required(
        monkeypatch) -> None:
    """Without PostgreSQL or Redis binaries (a wheel runner, a machine the servers were not
    installed on) the tests that need them are skipped, each naming what is missing; where
    ``LOCKMGR_REQUIRE_SERVERS=1`` (``.ci/run``) the same is an error."""
    monkeypatch.setattr(pgserver.shutil, "which", lambda name: None)
    monkeypatch.setattr(pgserver.glob, "glob", lambda pattern: [])
    monkeypatch.delenv("LOCKMGR_REQUIRE_SERVERS", raising=False)
    for require, binary in ((pgserver.require_postgres, "PostgreSQL server (initdb)"),
                            (pgserver.require_redis_server, "redis-server")):
        with pytest.raises(pytest.skip.Exception, match=rf"no {re.escape(binary)} on this"):
            require()
    monkeypatch.setenv("LOCKMGR_REQUIRE_SERVERS", "1")
    with pytest.raises(RuntimeError, match="no redis-server on this machine.*an error"):
        pgserver.require_redis_server()


@pytest.mark.parametrize("owner", ["thread", "task"])
def test_a_timed_out_wait_leaves_no_reference_cycle(engine, dsn, namespace, owner,
                                                    workers) -> None:
    """A timed wait the server ends (LockNotAvailable, thrown into the lock call's steps and
    answered with a time-out) is freed by reference counting alone: no cycle through the
    error's traceback keeps the driver's and the steps' frames (and with them the session,
    its connection and the manager) until the collector runs."""
    locks: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    other: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    holder = workers("holder")  # (the caller's own lock through other would be refused)
    holder.run(lambda: other.acquire("k"))

    async def tasks_time_out() -> None:
        for _ in range(5):
            assert await locks.aio.acquire("k", timeout=0.1) is False

    try:
        gc.collect()
        gc.disable()
        try:
            if owner == "thread":
                for _ in range(5):
                    assert locks.acquire("k", timeout=0.1) is False
            else:
                asyncio.run(tasks_time_out())
            left = sum(isinstance(o, psycopg.errors.LockNotAvailable) for o in gc.get_objects())
        finally:
            gc.enable()
        assert left == 0, f"{left} LockNotAvailable errors kept alive by reference cycles"
    finally:
        holder.run(lambda: other.release("k"))
        other.close()
        locks.close()


def test_ctrl_c_while_a_threads_session_is_made_leaves_nothing_behind(
        locks, dsn, monkeypatch) -> None:
    """Ctrl-C landing in the making of the thread's session record (its first call): the
    call raises KeyboardInterrupt, the half-made record goes quietly (no "Exception
    ignored" from its finalizer), and the thread's next call works."""
    from lockmgr.postgres import _session

    def interrupted() -> _Session:
        raise KeyboardInterrupt

    unraisable: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(_session, "_Session", interrupted)
    with pytest.raises(KeyboardInterrupt):
        locks.acquire("k")
    gc.collect()
    monkeypatch.undo()
    assert unraisable == []
    assert locks.acquire("k", timeout=0) is True
    locks.release("k")
    assert not held_on_server(dsn, locks, "k")
