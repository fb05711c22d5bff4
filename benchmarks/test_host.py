"""lockmgr.host's uncontended acquire+release pair, on both engines, beside the in-process
manager's: what sharing a key with the other processes of the host adds.

Run: pip install -e '.[bench]' && pytest benchmarks/test_host.py --benchmark-group-by=group
(``lockmgr-bench --scenario host`` puts it beside filelock, portalocker, fasteners and
PostgreSQL, across processes.)
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockmgr.host import HostLockManager, _managers

ENGINES = ["lockmgr._core", "lockmgr._pure"]
KEY = "user:42"


@pytest.fixture(params=ENGINES, ids=["cython", "python"])
def host_locks(request: pytest.FixtureRequest, tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> Iterator[HostLockManager[str]]:
    # The host manager's in-process layer on the engine of this run (as tests/host does).
    monkeypatch.setattr(_managers, "LockManager", importlib.import_module(request.param).LockManager)
    with HostLockManager(tmp_path / "locks") as locks:
        yield locks


def _pairs(acquire, release):  # type: ignore[no-untyped-def]
    def run() -> None:
        for _ in range(1000):
            acquire(KEY)
            release(KEY)

    return run


@pytest.mark.benchmark(group="host acquire+release x1000")
def test_host_pair(benchmark, host_locks) -> None:  # type: ignore[no-untyped-def]
    benchmark(_pairs(host_locks.acquire, host_locks.release))


@pytest.mark.benchmark(group="host acquire+release x1000")
def test_in_process_pair(benchmark) -> None:  # type: ignore[no-untyped-def]
    locks = importlib.import_module("lockmgr._core").LockManager()
    benchmark(_pairs(locks.acquire, locks.release))
