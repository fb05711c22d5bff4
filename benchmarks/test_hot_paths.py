"""The uncontended hot paths, both engines beside threading.RLock.

Run: pip install -e '.[bench]' && pytest benchmarks --benchmark-group-by=group
"""

from __future__ import annotations

import importlib
import threading

import pytest

ENGINES = ["lockmgr._core", "lockmgr._pure"]
KEY = "user:42"


@pytest.fixture(params=ENGINES, ids=["cython", "python"])
def locks(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return importlib.import_module(request.param).LockManager()


def _pairs(acquire, release, *args):  # type: ignore[no-untyped-def]
    def run() -> None:
        for _ in range(1000):
            acquire(*args)
            release(*args)

    return run


@pytest.mark.benchmark(group="acquire+release x1000")
def test_rlock_pair(benchmark) -> None:  # type: ignore[no-untyped-def]
    lock = threading.RLock()
    benchmark(_pairs(lock.acquire, lock.release))


@pytest.mark.benchmark(group="acquire+release x1000")
def test_manager_pair(benchmark, locks) -> None:  # type: ignore[no-untyped-def]
    benchmark(_pairs(locks.acquire, locks.release, KEY))


@pytest.mark.benchmark(group="with block x1000")
def test_rlock_with(benchmark) -> None:  # type: ignore[no-untyped-def]
    lock = threading.RLock()

    def run() -> None:
        for _ in range(1000):
            with lock:
                pass

    benchmark(run)


@pytest.mark.benchmark(group="with block x1000")
def test_manager_view_with(benchmark, locks) -> None:  # type: ignore[no-untyped-def]
    def run() -> None:
        for _ in range(1000):
            with locks[KEY]:
                pass

    benchmark(run)


@pytest.mark.benchmark(group="with block x1000")
def test_manager_hold_with(benchmark, locks) -> None:  # type: ignore[no-untyped-def]
    def run() -> None:
        for _ in range(1000):
            with locks.hold(KEY):
                pass

    benchmark(run)


@pytest.mark.benchmark(group="reentrant acquire+release x1000")
def test_manager_reentrant_pair(benchmark, locks) -> None:  # type: ignore[no-untyped-def]
    locks.acquire(KEY)
    benchmark(_pairs(locks.acquire, locks.release, KEY))
    locks.release(KEY)
