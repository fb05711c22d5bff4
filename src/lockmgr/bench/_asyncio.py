"""The asyncio scenarios: lockmgr's ``aio`` views beside ``asyncio.Lock`` and friends."""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import itertools
import random
import time
import tracemalloc
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _pure
from ._measure import progress
from ._threads import STRIPES, max_overtaken

if TYPE_CHECKING:
    from ._measure import Results, Settings
    from ._threads import Key


# -- asyncio ---------------------------------------------------------------------------------

ASYNC_BASELINE = "asyncio.Lock"
HOT_TASKS = 100  # asyncio-hot-key: tasks on one key
MANY_TASKS = 1000  # asyncio-many-keys: tasks ...
MANY_KEYS = 100  # ... over this many keys,
MANY_HOLD_SECONDS = 0.001  # each holding its key across an ``await asyncio.sleep()`` this long
ASYNC_MEMORY_KEYS = 200_000  # asyncio-memory: distinct keys locked and released one by one


@dataclass
class AsyncSubject:
    """One implementation as the asyncio scenarios drive it, from inside a running task."""

    view: Callable[[Key], AbstractAsyncContextManager[Any]]  # key -> ``async with`` holding it
    with_block: tuple[str, dict[str, Any]]  # statement + names: one ``async with`` block
    pair: tuple[str, dict[str, Any]] | None = None  # statement + names: acquire + release
    hold: tuple[str, dict[str, Any]] | None = None  # lockmgr's ``async with aio.hold(key)``
    per_key_memory: bool = True  # whether memory grows per key (not for one global lock)


def _lockmgr_aio(manager_class: Any, **options: Any) -> Callable[[], AsyncSubject]:
    def make() -> AsyncSubject:
        aio = manager_class(**options).aio
        names = {"a": aio.acquire, "r": aio.release, "m": aio, "k": "user:42"}
        return AsyncSubject(view=aio.__getitem__, pair=("await a(k); r(k)", names),
                            with_block=("async with m[k]: pass", names),
                            hold=("async with m.hold(k): pass", names))

    return make


def _asyncio_lock() -> AsyncSubject:
    lock = asyncio.Lock()  # bound to the loop that first waits on it: one subject, one run
    names = {"a": lock.acquire, "r": lock.release, "l": lock}
    return AsyncSubject(view=lambda key: lock, pair=("await a(); r()", names),
                        with_block=("async with l: pass", names), per_key_memory=False)


def _dict_of_asyncio_locks() -> AsyncSubject:
    locks: collections.defaultdict[Key, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
    names = {"d": locks, "k": "user:42"}
    return AsyncSubject(view=locks.__getitem__,
                        pair=("await d[k].acquire(); d[k].release()", names),
                        with_block=("async with d[k]: pass", names))


def _asyncio_keyed_lock(module: Any) -> Callable[[], AsyncSubject]:
    def make() -> AsyncSubject:
        locks = module.AsyncioKeyedLock()  # ``async with locks(key)``; no acquire/release
        return AsyncSubject(view=locks, with_block=("async with l(k): pass",
                                                    {"l": locks, "k": "user:42"}))

    return make


def async_implementations() -> dict[str, Callable[[], AsyncSubject]]:
    """What the asyncio scenarios run: lockmgr's ``aio`` views (the same names as the
    managers in the thread scenarios), one global ``asyncio.Lock``, ``defaultdict(asyncio.Lock)``
    and the asyncio-keyed-lock package (from the [bench] and [test] extras) if installed."""
    found: dict[str, Callable[[], AsyncSubject]] = {}
    try:
        compiled = importlib.import_module("lockmgr._core")
    except ImportError:
        compiled = None
    if compiled is not None and hasattr(compiled.LockManager, "aio"):
        found["lockmgr"] = _lockmgr_aio(compiled.LockManager)
        found["lockmgr-unfair"] = _lockmgr_aio(compiled.LockManager, fair=False)
        found["striped"] = _lockmgr_aio(compiled.LockManager, stripes=STRIPES)
    if hasattr(_pure.LockManager, "aio"):
        found["lockmgr-pure"] = _lockmgr_aio(_pure.LockManager)
    if not found:
        progress("this lockmgr has no asyncio API (LockManager.aio): asyncio scenarios "
                 "show the others only")
    found[ASYNC_BASELINE] = _asyncio_lock
    found["dict-of-asyncio-locks"] = _dict_of_asyncio_locks
    try:
        keyed = importlib.import_module("asyncio_keyed_lock")
    except ImportError:
        progress("asyncio-keyed-lock is not installed (pip install 'lockmgr[bench]'): "
                 "asyncio scenarios leave it out")
    else:
        found["asyncio-keyed-lock"] = _asyncio_keyed_lock(keyed)
    return found


def _async_seconds_per_run(statement: tuple[str, dict[str, Any]], number: int) -> float:
    """Seconds per run of ``statement`` inside one coroutine, the best of 5 rounds of
    ``number`` (after a warm-up round), its names being the coroutine's locals."""
    code, names = statement
    source = (f"async def _timed(_number, {', '.join(names)}):\n"
              f"    _began = _clock()\n"
              f"    for _ in range(_number):\n"
              f"        {code}\n"
              f"    return _clock() - _began\n")
    namespace: dict[str, Any] = {"_clock": time.perf_counter}
    exec(source, namespace)  # noqa: S102 - the benchmark's own statements
    timed = namespace["_timed"]

    async def rounds() -> float:
        await timed(min(number, 1000), **names)
        return min([float(await timed(number, **names)) for _ in range(5)])

    return asyncio.run(rounds()) / number


def asyncio_uncontended(name: str, subject: AsyncSubject, settings: Settings,
                        results: Results) -> None:
    """One task takes and gives back one key, over and over: ``async with`` (lockmgr:
    ``async with aio[key]`` with ``aio = locks.aio`` bound once), acquire + release, and
    ``async with aio.hold(key)``."""
    number = int(settings.scaled(100_000, 1_000_000))
    if name == "lockmgr-pure":
        number //= 10
    scenario = "asyncio-uncontended"
    results.add(scenario, name, "with-block",
                _async_seconds_per_run(subject.with_block, number) * 1e9, "ns")
    if subject.pair is not None:
        results.add(scenario, name, "acquire+release",
                    _async_seconds_per_run(subject.pair, number) * 1e9, "ns")
    if subject.hold is not None:
        results.add(scenario, name, "with-hold",
                    _async_seconds_per_run(subject.hold, number) * 1e9, "ns")


async def _run_tasks_for(seconds: float, bodies: list[Callable[[], Any]],
                         stop: list[bool]) -> float:
    """Start one task per body, let them go together, set ``stop[0]`` after ``seconds``
    and wait for them all; returns how long they ran before the stop. (A body counts only
    work it finished while ``stop[0]`` was false: the draining afterwards is not timed.)"""
    go = asyncio.Event()

    async def run(body: Callable[[], Any]) -> None:
        await go.wait()
        await body()

    tasks = [asyncio.ensure_future(run(body)) for body in bodies]
    await asyncio.sleep(0)  # every task started and waiting for ``go``
    go.set()
    began = time.perf_counter()
    await asyncio.sleep(seconds)
    stop[0] = True
    elapsed = time.perf_counter() - began
    await asyncio.gather(*tasks)
    return elapsed


def asyncio_hot_key(name: str, subject: AsyncSubject, settings: Settings,
                    results: Results) -> None:
    """100 tasks on one key, each holding it across an ``await asyncio.sleep(0)`` (so that
    the others queue behind it): acquisitions per second, and the most grants any task saw
    go to tasks that asked after it. The ticket is taken just before ``async with``; in one
    event loop nothing runs between the two, so every overtake is the lock's own doing."""
    tickets = itertools.count()
    grants: list[int] = []
    counted = [0]
    stop = [False]

    async def body() -> None:
        while not stop[0]:
            ticket = next(tickets)
            async with subject.view("hot"):
                grants.append(ticket)
                if not stop[0]:
                    counted[0] += 1
                await asyncio.sleep(0)

    bodies = [body] * HOT_TASKS
    elapsed = asyncio.run(_run_tasks_for(settings.scaled(1.0, 3.0), bodies, stop))
    results.add("asyncio-hot-key", name, "throughput", counted[0] / elapsed, "acq/s")
    results.add("asyncio-hot-key", name, "max-overtaken", max_overtaken(grants), "times")


def asyncio_many_keys(name: str, subject: AsyncSubject, settings: Settings,
                      results: Results) -> None:
    """1,000 tasks over 100 keys (each task its own random sequence), each holding its key
    across ``await asyncio.sleep(0.001)`` (a request's I/O): completed holds per second, and
    how often a holder found another holder of its key inside (mutual exclusion: 0)."""
    plans = [[f"key-{rng.randrange(MANY_KEYS)}" for _ in range(64)]
             for rng in map(random.Random, range(MANY_TASKS))]
    inside: collections.Counter[str] = collections.Counter()
    counted = [0, 0]  # holds finished before the stop, holders that found company
    stop = [False]

    def body_for(plan: list[str]) -> Callable[[], Any]:
        async def body() -> None:
            for key in itertools.cycle(plan):
                if stop[0]:
                    return
                async with subject.view(key):
                    if stop[0]:
                        return
                    inside[key] += 1
                    counted[1] += inside[key] > 1
                    await asyncio.sleep(MANY_HOLD_SECONDS)
                    inside[key] -= 1
                    if not stop[0]:
                        counted[0] += 1

        return body

    bodies = [body_for(plan) for plan in plans]
    elapsed = asyncio.run(_run_tasks_for(settings.scaled(1.0, 3.0), bodies, stop))
    results.add("asyncio-many-keys", name, "throughput", counted[0] / elapsed, "holds/s")
    results.add("asyncio-many-keys", name, "not-exclusive", counted[1], "times")


def asyncio_memory(name: str, subject: AsyncSubject, settings: Settings,
                   results: Results) -> None:
    """What is left allocated (tracemalloc) after one task has locked and released 200,000
    distinct keys one after the other: per-key tables that never forget keep them all."""
    if not subject.per_key_memory:
        return

    async def residue() -> int:
        for index in range(64):  # warm-up: the task's own state, spare entries
            async with subject.view(("warm-up", index)):
                pass
        start = tracemalloc.get_traced_memory()[0]
        for index in range(ASYNC_MEMORY_KEYS):  # each key made here and dropped after
            async with subject.view(("residue", index)):
                pass
        return tracemalloc.get_traced_memory()[0] - start

    tracemalloc.start()
    try:
        left = asyncio.run(residue())
    finally:
        tracemalloc.stop()
    results.add("asyncio-memory", name, f"residue-after-{ASYNC_MEMORY_KEYS}-keys", left, "B")


ASYNC_SCENARIOS: dict[str, Callable[[str, AsyncSubject, Settings, Results], None]] = {
    "asyncio-uncontended": asyncio_uncontended,
    "asyncio-hot-key": asyncio_hot_key,
    "asyncio-many-keys": asyncio_many_keys,
    "asyncio-memory": asyncio_memory,
}
