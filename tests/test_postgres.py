"""The PostgreSQL backend against a real server, in-process and across processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import pgserver
from conftest import PATIENCE, wait_until
from lockmgr import DeadlockError, LockError, LockLost, LockTimeout, NotOwnedError

import psycopg  # part of the [test] extra: missing, the suite fails rather than skips
from lockmgr import postgres


@pytest.fixture(scope="module")
def dsn() -> Iterator[str]:
    with pgserver.running_server() as running:
        yield running


@pytest.fixture
def engine(impl, monkeypatch):  # type: ignore[no-untyped-def]
    """Run the backend over the in-process engine under test."""
    monkeypatch.setattr(postgres, "LockManager", impl.LockManager)
    monkeypatch.setattr(postgres, "RWLockManager", impl.RWLockManager)
    return impl


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4()}"


@pytest.fixture
def locks(engine, dsn, namespace) -> Iterator[postgres.PgLockManager[Any]]:  # type: ignore[no-untyped-def]
    manager: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    yield manager
    manager.release_all()
    manager.close()


def held_on_server(dsn: str, manager: Any, key: object) -> bool:
    """Whether any session holds ``key``, asked on a connection of the test's own."""
    return postgres._locked_on_server(dsn, manager.advisory_key(key), None, {})


CHILD = """
import json, os, signal, sys, threading, time
from lockmgr import postgres, LockLost, DeadlockError
locks = postgres.{cls}(os.environ["DSN"], namespace=os.environ["NAMESPACE"])
def say(**what):
    print(json.dumps(what), flush=True)
{body}
"""


def child(dsn: str, namespace: str, body: str, cls: str = "PgLockManager",
          pure: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "DSN": dsn, "NAMESPACE": namespace,
           "LOCKMGR_NO_EXTENSIONS": "1" if pure else ""}
    code = CHILD.format(cls=cls, body=textwrap.dedent(body))
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def expect(process: subprocess.Popen[str], **what: object) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, process.stderr.read() if process.stderr else "no output"
    said: dict[str, Any] = json.loads(line)
    assert {key: said.get(key) for key in what} == what, said
    return said


def finish(process: subprocess.Popen[str]) -> None:
    try:
        out, err = process.communicate("go\n", timeout=PATIENCE)
    finally:
        process.kill()
    assert process.returncode == 0, err


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
    with pytest.raises(NotOwnedError):
        locks.release("k")
    with pytest.raises(ValueError):
        locks.acquire("k", timeout=-2)
    with pytest.raises(TypeError):
        locks.acquire(1.5)
    with locks.hold("k", timeout=1) as entered, locks["j"]:
        assert entered is True and locks.owned("j")
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


def _waiting_on_server(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                           " AND NOT granted").fetchone()
    return int(row[0]) if row else 0


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
    with pytest.raises(LockLost):
        locks.release("k")
    assert not locks.owned("k") and len(locks) == 0 and locks.lost_keys() == set()
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
        with conn.transaction():
            with locks.xact_lock(conn, "k"):
                assert locks.acquire("k", timeout=0) is False  # the same lock
            assert held_on_server(dsn, locks, "k")  # leaving the block does not release it
        assert not held_on_server(dsn, locks, "k")  # the commit did
        with pytest.raises(RuntimeError):
            with conn.transaction():
                with locks.xact_lock(conn, "k", shared=True, timeout=1):
                    raise RuntimeError("roll back")
        assert not held_on_server(dsn, locks, "k")  # so did the rollback
        locks.acquire("k")
        with conn.transaction():
            with pytest.raises(LockTimeout):
                with locks.xact_lock(conn, "k", timeout=0.1):
                    pass
            with pytest.raises(LockTimeout):
                with locks.xact_lock(conn, "k", timeout=0):
                    pass
            assert conn.execute("SELECT 1").fetchone() == (1,)  # the transaction goes on
        locks.release("k")
    finally:
        conn.close()


def test_bench_adds_postgres_in_process_and_across_processes(dsn, tmp_path) -> None:
    from lockmgr import bench

    out = tmp_path / "pg.json"
    assert bench.main(["--quick", "--pg-dsn", dsn, "--scenario", "many-keys", "--threads", "2",
                       "--impl", "postgres", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {row["impl"] for row in rows} == {"postgres", "postgres-processes"}
    assert all(row["metric"] == "throughput" and row["value"] > 0 for row in rows)
