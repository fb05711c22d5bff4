"""``--scenario limits``: ``SemaphoreManager`` beside what people write by hand for a limit
per key, each figure of a row beside that row's reference (named in the metric):

- the uncontended pair of a limit of 1 beside ``LockManager``'s pair (the same path);
- the uncontended pair of a limit of 4 beside a ``threading.BoundedSemaphore`` taken from a
  dict (get, or create and insert: the dict grows for ever, as it does in such code);
- 1,000 tasks over 100 tenant keys, limit 4, each holding its slot across an
  ``await asyncio.sleep(0)``: completed holds per second, and how many grants went to a
  task that asked for the key after another one still waiting (0: FIFO), beside a dict of
  ``asyncio.Semaphore`` under one ``asyncio.Lock`` for the dict, which drops a key's
  semaphore when its last user leaves (so that memory follows the keys in use, as
  lockmgr's does).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
import timeit
from collections.abc import Callable
from typing import Any

from ._measure import Results, Settings

SCENARIO = "limits"
REFERENCE = "hand-written"  # the column of each row's reference (named in its metric)
LIMIT = 4
TASKS = 1000
TENANTS = 100


def limits_subjects() -> dict[str, Any]:
    """The engines to measure: the one lockmgr uses, and the pure twin."""
    import lockmgr
    from lockmgr import _pure

    subjects: dict[str, Any] = {"lockmgr": lockmgr}
    if lockmgr.implementation != "python":
        subjects["lockmgr-pure"] = _pure
    return subjects


def _pair_ns(acquire: Callable[[str], object], release: Callable[[str], object],
             number: int) -> float:
    """Nanoseconds per acquire + release of one key by one thread, the best of 5 rounds."""
    def pairs() -> None:
        for _ in range(number):
            acquire("tenant")
            release("tenant")

    return min(timeit.repeat(pairs, number=1, repeat=5)) / number * 1e9


def _bounded_semaphores() -> tuple[Callable[[str], object], Callable[[str], object]]:
    semaphores: dict[str, threading.BoundedSemaphore] = {}

    def acquire(key: str) -> object:
        semaphore = semaphores.get(key)
        if semaphore is None:
            semaphore = semaphores.setdefault(key, threading.BoundedSemaphore(LIMIT))
        return semaphore.acquire()

    def release(key: str) -> object:
        semaphores[key].release()
        return None

    return acquire, release


class _DictOfAsyncioSemaphores:
    """A dict of ``asyncio.Semaphore`` under one ``asyncio.Lock``, each key's dropped when
    its last user leaves: the hand-written limit per key for tasks."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.guard = asyncio.Lock()
        self.semaphores: dict[str, asyncio.Semaphore] = {}
        self.users: collections.Counter[str] = collections.Counter()

    def hold(self, key: str) -> _Held:
        return _Held(self, key)


class _Held:
    __slots__ = ("key", "owner", "semaphore")

    def __init__(self, owner: _DictOfAsyncioSemaphores, key: str) -> None:
        self.owner = owner
        self.key = key

    async def __aenter__(self) -> None:
        owner = self.owner
        async with owner.guard:
            semaphore = owner.semaphores.get(self.key)
            if semaphore is None:
                semaphore = owner.semaphores[self.key] = asyncio.Semaphore(owner.limit)
            owner.users[self.key] += 1
        self.semaphore = semaphore
        try:
            await semaphore.acquire()
        except BaseException:
            await self._leave()
            raise

    async def __aexit__(self, *exc_info: object) -> None:
        self.semaphore.release()
        await self._leave()

    async def _leave(self) -> None:
        owner = self.owner
        async with owner.guard:
            owner.users[self.key] -= 1
            if not owner.users[self.key]:
                del owner.users[self.key], owner.semaphores[self.key]


def _tenants(hold: Callable[[str], Any], seconds: float) -> tuple[float, int]:
    """1,000 tasks over 100 tenant keys (each its own random sequence), each holding a slot
    across ``await asyncio.sleep(0)``: holds per second, and overtakes: a task that had to
    wait got in while a task that asked for that key before it still had not.

    Each task's ticket is taken just before it asks; nothing runs in between in one event
    loop, so an overtake is the semaphore's own doing. A task that got in without waiting
    is not counted: lockmgr hands a slot to the oldest waiter when it is released, before
    that waiter runs again, so a newcomer taking a slot freed after that is no overtake,
    though the waiter has not run yet (the tests check that no newcomer takes a slot
    while anyone queues: tests/engine/test_semaphores.py)."""
    plans = [[f"tenant-{rng.randrange(TENANTS)}" for _ in range(64)]
             for rng in map(random.Random, range(TASKS))]
    tickets = itertools.count()
    waiting: dict[str, set[int]] = collections.defaultdict(set)
    counted = [0, 0, 0]  # holds finished before the stop, overtakes, entries so far
    stop = [False]

    async def body(plan: list[str]) -> None:
        for key in itertools.cycle(plan):
            if stop[0]:
                return
            ticket = next(tickets)
            waiting[key].add(ticket)
            entries = counted[2]
            async with hold(key):
                counted[2] += 1
                queued = waiting[key]
                queued.discard(ticket)
                waited = counted[2] - 1 != entries  # others got in meanwhile: it waited
                counted[1] += waited and bool(queued) and min(queued) < ticket
                await asyncio.sleep(0)
                if not stop[0]:
                    counted[0] += 1

    async def main() -> float:
        loop = asyncio.get_running_loop()
        tasks = [asyncio.ensure_future(body(plan)) for plan in plans]
        began = loop.time()
        await asyncio.sleep(seconds)
        stop[0] = True
        elapsed = loop.time() - began
        await asyncio.gather(*tasks)
        return elapsed

    elapsed = asyncio.run(main())
    return counted[0] / elapsed, counted[1]


def limits(name: str, engine: Any, settings: Settings, results: Results) -> None:
    """The scenario for the engine ``engine`` (a module with ``SemaphoreManager`` and
    ``LockManager``), with the hand-written references measured once, beside lockmgr."""
    number = int(settings.scaled(100_000, 1_000_000))
    if name == "lockmgr-pure":
        number //= 10
    one = engine.SemaphoreManager(1)
    results.add(SCENARIO, name, "pair, limit 1 (reference: LockManager)",
                _pair_ns(one.acquire, one.release, number), "ns")
    four = engine.SemaphoreManager(LIMIT)
    results.add(SCENARIO, name, "pair, limit 4 (reference: dict of BoundedSemaphore)",
                _pair_ns(four.acquire, four.release, number), "ns")
    seconds = settings.scaled(1.0, 3.0)
    aio = engine.SemaphoreManager(LIMIT).aio
    rate, overtakes = _tenants(aio.hold, seconds)
    tasks = "1,000 tasks x 100 keys, limit 4 (reference: dict of asyncio.Semaphore)"
    results.add(SCENARIO, name, tasks, rate, "holds/s")
    results.add(SCENARIO, name, "overtakes of those tasks", overtakes, "times")
    if name != "lockmgr":
        return
    locks = engine.LockManager()
    results.add(SCENARIO, REFERENCE, "pair, limit 1 (reference: LockManager)",
                _pair_ns(locks.acquire, locks.release, number), "ns")
    results.add(SCENARIO, REFERENCE, "pair, limit 4 (reference: dict of BoundedSemaphore)",
                _pair_ns(*_bounded_semaphores(), number), "ns")
    rate, overtakes = _tenants(_DictOfAsyncioSemaphores(LIMIT).hold, seconds)
    results.add(SCENARIO, REFERENCE, tasks, rate, "holds/s")
    results.add(SCENARIO, REFERENCE, "overtakes of those tasks", overtakes, "times")
