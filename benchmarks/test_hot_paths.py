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


PAIRS = 20_000


def _spread(make_own_lock, threads: int):  # type: ignore[no-untyped-def]
    """PAIRS acquire+release pairs shared out among ``threads`` threads, each on a lock of
    its own (nothing contended): with the GIL off, 2 threads should take about half the time
    of 1 on a machine with 2 free cores; with a GIL, about the same."""
    def run() -> None:
        def body(acquire, release) -> None:  # type: ignore[no-untyped-def]
            for _ in range(PAIRS // threads):
                acquire()
                release()

        workers = [threading.Thread(target=body, args=make_own_lock(index))
                   for index in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    return run


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.benchmark(group="distinct keys per thread: 20,000 pairs in all")
def test_rlock_per_thread(benchmark, threads) -> None:  # type: ignore[no-untyped-def]
    def own(index: int):  # type: ignore[no-untyped-def]
        lock = threading.RLock()
        return lock.acquire, lock.release

    benchmark(_spread(own, threads))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.benchmark(group="distinct keys per thread: 20,000 pairs in all")
def test_manager_key_per_thread(benchmark, locks, threads) -> None:  # type: ignore[no-untyped-def]
    def own(index: int):  # type: ignore[no-untyped-def]
        key = f"thread-{index}"
        return (lambda: locks.acquire(key)), (lambda: locks.release(key))

    benchmark(_spread(own, threads))


# -- SemaphoreManager: a limit of 1 is the exclusive lock's path -----------------------------


@pytest.fixture(params=ENGINES, ids=["cython", "python"])
def engine(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return importlib.import_module(request.param)


@pytest.mark.benchmark(group="limit 1 acquire+release x1000")
def test_lock_manager_pair_beside_limit_one(benchmark, engine) -> None:  # type: ignore[no-untyped-def]
    locks = engine.LockManager()
    benchmark(_pairs(locks.acquire, locks.release, KEY))


@pytest.mark.benchmark(group="limit 1 acquire+release x1000")
def test_semaphore_limit_one_pair(benchmark, engine) -> None:  # type: ignore[no-untyped-def]
    slots = engine.SemaphoreManager(1)
    benchmark(_pairs(slots.acquire, slots.release, KEY))


@pytest.mark.benchmark(group="limit 4 acquire+release x1000")
def test_bounded_semaphore_from_a_dict_pair(benchmark) -> None:  # type: ignore[no-untyped-def]
    semaphores: dict[str, threading.BoundedSemaphore] = {}

    def acquire(key: str) -> None:
        semaphore = semaphores.get(key)
        if semaphore is None:
            semaphore = semaphores.setdefault(key, threading.BoundedSemaphore(4))
        semaphore.acquire()

    def release(key: str) -> None:
        semaphores[key].release()

    benchmark(_pairs(acquire, release, KEY))


@pytest.mark.benchmark(group="limit 4 acquire+release x1000")
def test_semaphore_limit_four_pair(benchmark, engine) -> None:  # type: ignore[no-untyped-def]
    slots = engine.SemaphoreManager(4)
    benchmark(_pairs(slots.acquire, slots.release, KEY))
