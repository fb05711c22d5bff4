"""asyncio: lockmgr's ``aio`` view (both engines) beside asyncio.Lock, defaultdict(asyncio.Lock)
and asyncio-keyed-lock — an uncontended ``async with``, one hot key among 100 tasks, and
1,000 tasks over 100 keys holding across ``await asyncio.sleep(0.001)``. The same workloads
as ``lockmgr-bench``'s asyncio scenarios, as pytest-benchmark groups (issue 14).

Run: pip install -e '.[bench]' && pytest benchmarks --benchmark-group-by=group
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import random
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import pytest

KEY = "user:42"
View = Callable[[Any], AbstractAsyncContextManager[Any]]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _lockmgr(engine: str) -> View:
    manager_class = importlib.import_module(engine).LockManager
    if not hasattr(manager_class, "aio"):
        pytest.skip(f"{engine}.LockManager has no aio view yet (issue 14)")
    return manager_class().aio.__getitem__  # type: ignore[no-any-return]


def _global_lock() -> View:
    lock = asyncio.Lock()
    return lambda key: lock


def _dict_of_locks() -> View:
    return collections.defaultdict(asyncio.Lock).__getitem__


def _keyed_lock() -> View:
    module = pytest.importorskip("asyncio_keyed_lock", reason="pip install -e '.[bench]'")
    return module.AsyncioKeyedLock()  # type: ignore[no-any-return]


SUBJECTS: dict[str, Callable[[], View]] = {
    "lockmgr-cython": lambda: _lockmgr("lockmgr._core"),
    "lockmgr-python": lambda: _lockmgr("lockmgr._pure"),
    "asyncio.Lock": _global_lock,
    "defaultdict(asyncio.Lock)": _dict_of_locks,
    "asyncio-keyed-lock": _keyed_lock,
}


@pytest.fixture(params=list(SUBJECTS))
def view(request: pytest.FixtureRequest) -> View:
    """key -> an ``async with`` holding it; asyncio.Lock is one lock for every key."""
    return SUBJECTS[request.param]()


@pytest.mark.benchmark(group="asyncio: uncontended async with x1000")
def test_uncontended(benchmark, loop, view) -> None:  # type: ignore[no-untyped-def]
    async def run() -> None:
        for _ in range(1000):
            async with view(KEY):
                pass

    benchmark(lambda: loop.run_until_complete(run()))


HOT_TASKS = 100
HOT_ROUNDS = 5  # acquisitions per task: 500 in all, each with 99 tasks queued behind


@pytest.mark.benchmark(group="asyncio: one hot key, 100 tasks, 500 acquisitions")
def test_hot_key(benchmark, loop, view) -> None:  # type: ignore[no-untyped-def]
    """Each task holds the key across ``await asyncio.sleep(0)``, so the others queue."""
    async def task() -> None:
        for _ in range(HOT_ROUNDS):
            async with view("hot"):
                await asyncio.sleep(0)

    async def run() -> None:
        await asyncio.gather(*(task() for _ in range(HOT_TASKS)))

    benchmark.pedantic(lambda: loop.run_until_complete(run()), rounds=3, iterations=1)


MANY_TASKS = 1000
MANY_KEYS = 100
HOLD_SECONDS = 0.001


@pytest.mark.benchmark(group="asyncio: 1,000 tasks over 100 keys, each holding one across sleep(1 ms)")
def test_many_keys(benchmark, loop, view) -> None:  # type: ignore[no-untyped-def]
    """One global asyncio.Lock takes 1,000 x 1 ms and more; a lock per key about 10 x 1 ms
    per key, the keys side by side."""
    rng = random.Random(14)
    keys = [f"key-{rng.randrange(MANY_KEYS)}" for _ in range(MANY_TASKS)]

    async def task(key: str) -> None:
        async with view(key):
            await asyncio.sleep(HOLD_SECONDS)

    async def run() -> None:
        await asyncio.gather(*(task(key) for key in keys))

    benchmark.pedantic(lambda: loop.run_until_complete(run()), rounds=3, iterations=1)


BANK_TASKS = 100
BANK_ACCOUNTS = 2_000
BANK_TRANSFERS = 5  # per task: 500 in all


@pytest.mark.parametrize("keys", ["a key per account", "one key for the bank"])
@pytest.mark.parametrize("engine", ["lockmgr._core", "lockmgr._pure"])
@pytest.mark.benchmark(group="asyncio: 100 tasks x 5 transfers among 2,000 accounts, both held "
                             "across sleep(1 ms)")
def test_transfers(benchmark, loop, engine: str, keys: str) -> None:  # type: ignore[no-untyped-def]
    """tests/aio/test_aio_service.py's bank without the HTTP: each transfer holds its two
    accounts (``aio.hold_many``) across a 1 ms wait. With a key per account the transfers
    overlap (about 5 x 1 ms in all); behind one key for the bank they queue (500 x 1 ms).
    The tests count the overlap; the ratio of the two is this group's."""
    aio = importlib.import_module(engine).LockManager().aio

    def key(account: int) -> str:
        return f"account:{account}" if keys == "a key per account" else "bank"

    rng = random.Random(14)
    plans = [[rng.sample(range(BANK_ACCOUNTS), 2) for _ in range(BANK_TRANSFERS)]
             for _ in range(BANK_TASKS)]

    async def task(plan: list[list[int]]) -> None:
        for src, dst in plan:
            async with aio.hold_many([key(src), key(dst)]):
                await asyncio.sleep(HOLD_SECONDS)

    async def run() -> None:
        await asyncio.gather(*(task(plan) for plan in plans))

    benchmark.pedantic(lambda: loop.run_until_complete(run()), rounds=3, iterations=1)
