"""The PostgreSQL tests' fixtures, a pytest plugin (``pytest_plugins`` in conftest.py): one
server per test module (``dsn``), the backend over the engine under test (``engine``), a
namespace per test, a manager closed after the test (``pg_locks``), and the checks each
PostgreSQL test module applies to its every test with
``pytestmark = pytest.mark.usefixtures("nothing_left_held", "children_reaped")``."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import pgserver
from conftest import PATIENCE
from lockmgr import postgres
from lockmgr.postgres import _managers
from pg_support import _children, own_sessions_locks


@pytest.fixture(scope="module")
def dsn() -> Iterator[str]:
    with pgserver.running_server() as running:
        yield running


@pytest.fixture
def nothing_left_held(dsn: str) -> Iterator[None]:
    """After every test, no session of this process holds an advisory lock."""
    yield
    assert own_sessions_locks(dsn) == 0


@pytest.fixture
def children_reaped() -> Iterator[None]:
    """After every test, each child process it started is ended and reaped and its pipes are
    closed, however the test ended (a failed or expected-to-fail test left to the garbage
    collector would make a later test report "subprocess is still running")."""
    yield
    while _children:
        process = _children.pop()
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=PATIENCE)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """Ctrl-C (SIGINT, or ``_thread.interrupt_main``) raises KeyboardInterrupt in this
    process during the test. A suite started as a background job of a shell without job
    control inherits SIGINT ignored, and Python then leaves it so: an interrupt the test
    sends itself would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def engine(impl, monkeypatch):  # type: ignore[no-untyped-def]
    """Run the backend over the in-process engine under test."""
    monkeypatch.setattr(_managers, "LockManager", impl.LockManager)
    monkeypatch.setattr(_managers, "RWLockManager", impl.RWLockManager)
    return impl


@pytest.fixture
def namespace() -> str:
    return f"test-{uuid.uuid4()}"


@pytest.fixture
def pg_locks(engine, dsn, namespace) -> Iterator[postgres.PgLockManager[Any]]:  # type: ignore[no-untyped-def]
    """A manager of this test's namespace, closed after it (tests/conftest.py's ``locks`` is
    the in-process engine's: a PostgreSQL test module names this one ``locks`` itself)."""
    manager: postgres.PgLockManager[Any] = postgres.PgLockManager(dsn, namespace=namespace)
    yield manager
    manager.close()
