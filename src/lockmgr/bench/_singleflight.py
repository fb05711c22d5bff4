"""The ``singleflight`` scenario: ``lockmgr.Singleflight`` (compiled engine, and its ``-pure``
row on the pure twin) beside the hand-written version people write, a dict of
``concurrent.futures.Future`` under one ``threading.Lock``; ratios to the latter.

- ``miss`` (ns): one caller, no one else: a call that starts and ends its own flight;
- ``hit`` (ns): a caller joining a call in flight whose result is ready (its runner has
  stored it and not yet left the table): what a caller's own code costs on a hit, without
  the sleep and wake-up (the runner's state is set up by hand, as it is at that instant);
- a *stampede*: ``CALLERS`` threads (1,000) released together ask for one key; the call
  returns once every other caller waits for it (each subject says how many wait: the
  engine's queue, the future's waiters). ``calls`` counts the calls made (1 is right);
  ``hand-off`` is from the call's return to the last caller's, per caller: what a hit on
  an in-flight call costs once its result is there; ``stampede`` is the whole episode,
  from the release to the last caller's return, per caller (thread wake-ups included);
- a *task stampede*: ``CALLERS`` asyncio tasks made at once ask for one key, whose call
  returns once every caller has asked; the episode per caller (the hand-written version:
  a dict of ``asyncio.Future`` in the tasks' loop).
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import timeit
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _pure
from .._flights import Flight
from .._singleflight import Singleflight, singleflight_on

if TYPE_CHECKING:
    from ._measure import Results, Settings

#: What the singleflight table's ratios divide by.
SINGLEFLIGHT_BASELINE = "dict-of-futures"
CALLERS = 1000
PATIENCE = 600.0  # a hang bound for a stampede


class DictOfFutures:
    """The hand-written singleflight: the first caller for a key puts a Future in a dict,
    runs the function and sets the Future; the others wait on it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.futures: dict[Any, Future[Any]] = {}
        self.task_futures: dict[Any, asyncio.Future[Any]] = {}

    def call(self, key: Any, fn: Callable[[], Any]) -> Any:
        with self._guard:
            future = self.futures.get(key)
            runs = future is None
            if future is None:
                future = self.futures[key] = Future()
        if not runs:
            return future.result()
        try:
            result = fn()
        except BaseException as error:
            self._retire(key)
            future.set_exception(error)
            raise
        self._retire(key)
        future.set_result(result)
        return result

    async def call_in_task(self, key: Any, coro_fn: Callable[[], Awaitable[Any]]) -> Any:
        """The same for tasks, with ``asyncio.Future`` (one loop's: no lock needed)."""
        future = self.task_futures.get(key)
        if future is not None:
            return await future
        future = self.task_futures[key] = asyncio.get_running_loop().create_future()
        try:
            result = await coro_fn()
        except BaseException as error:
            del self.task_futures[key]
            future.set_exception(error)
            future.exception()  # retrieved: a caller-less failure is no warning
            raise
        del self.task_futures[key]
        future.set_result(result)
        return result

    def _retire(self, key: Any) -> None:
        with self._guard:
            del self.futures[key]

    def ready(self, key: Any, result: Any) -> None:
        """``key``'s call in flight, its result set (the instant before it leaves)."""
        future: Future[Any] = Future()
        future.set_result(result)
        self.futures[key] = future

    def waiting(self, key: Any) -> int:
        future = self.futures.get(key)
        return 0 if future is None else len(future._condition._waiters)  # type: ignore[attr-defined]


@dataclass
class FlightSubject:
    call: Callable[[Any, Callable[[], Any]], Any]
    waiting: Callable[[Any], int]  # how many callers wait for the key's call
    ready: Callable[[Any, Any], None]  # key, result: the key's call in flight, its result set
    call_in_task: Callable[[Any, Callable[[], Awaitable[Any]]], Awaitable[Any]]


def _lockmgr(flight_class: type[Singleflight[Any, Any]]) -> Callable[[], FlightSubject]:
    def make() -> FlightSubject:
        flight = flight_class()
        locks = flight._table.locks
        def ready(key: Any, result: Any) -> None:
            done: Flight[Any] = Flight(key, -1, -1)  # no thread's: nobody recurses into it
            done.value = result
            flight._table.flights[key] = done

        return FlightSubject(flight.call, lambda key: locks.stats().waiting, ready,
                             flight.aio.call)

    return make


def _futures() -> FlightSubject:
    flights = DictOfFutures()
    return FlightSubject(flights.call, flights.waiting, flights.ready, flights.call_in_task)


#: The rows of the singleflight table: name -> how to make the subject.
SINGLEFLIGHT_SUBJECTS: dict[str, Callable[[], FlightSubject]] = {
    "lockmgr": _lockmgr(Singleflight),
    "lockmgr-pure": _lockmgr(singleflight_on(_pure)),
    SINGLEFLIGHT_BASELINE: _futures,
}


def call_ns(subject: FlightSubject, settings: Settings, key: str) -> float:
    """The best per-call time of ``subject.call(key, int)`` over a few repeats."""
    timer = timeit.Timer("call(key, fn)", globals={"call": subject.call, "fn": int, "key": key})
    number = int(settings.scaled(20_000, 200_000))
    return min(timer.repeat(repeat=5, number=number)) / number * 1e9


def stampede(subject: FlightSubject, callers: int) -> tuple[int, float, float]:
    """One stampede of ``callers`` threads: (calls made, hand-off s per caller, episode s
    per caller)."""
    calls: list[int] = []
    returned = [0.0] * callers
    go = threading.Barrier(callers + 1)
    call_returned = [0.0]

    def backend() -> str:
        calls.append(1)
        deadline = time.monotonic() + PATIENCE
        while subject.waiting("hot") < callers - 1:  # every other caller waits for it
            if time.monotonic() > deadline:
                raise TimeoutError("the stampede's callers did not all wait")
            time.sleep(0.0005)
        call_returned[0] = time.perf_counter()
        return "payload"

    def caller(index: int) -> None:
        go.wait(PATIENCE)
        subject.call("hot", backend)
        returned[index] = time.perf_counter()

    previous = threading.stack_size(256 * 1024)  # 1,000 threads: small stacks suffice
    try:
        threads = [threading.Thread(target=caller, args=(index,)) for index in range(callers)]
        for thread in threads:
            thread.start()
    finally:
        threading.stack_size(previous)
    go.wait(PATIENCE)
    began = time.perf_counter()
    for thread in threads:
        thread.join(PATIENCE)
    last = max(returned)
    return len(calls), (last - call_returned[0]) / (callers - 1), (last - began) / callers


def task_stampede(subject: FlightSubject, callers: int) -> float:
    """One stampede of ``callers`` tasks: the episode's seconds per caller."""
    asked = [0]

    async def backend() -> str:
        while asked[0] < callers:  # every caller has asked (each waits once it has)
            await asyncio.sleep(0)
        return "payload"

    async def caller() -> Any:
        asked[0] += 1
        return await subject.call_in_task("hot", backend)

    async def episode() -> float:
        began = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(caller() for _ in range(callers))), PATIENCE)
        return (time.perf_counter() - began) / callers

    return asyncio.run(episode())


def singleflight(name: str, settings: Settings, results: Results,
                 callers: int = CALLERS) -> None:
    subject = SINGLEFLIGHT_SUBJECTS[name]()
    results.add("singleflight", name, "miss", call_ns(subject, settings, "cold"), "ns")
    subject.ready("ready", "payload")
    results.add("singleflight", name, "hit", call_ns(subject, settings, "ready"), "ns")
    runs = [stampede(subject, callers) for _ in range(int(settings.scaled(3, 9)))]
    results.add("singleflight", name, f"calls for {callers} callers",
                max(calls for calls, _, _ in runs), "calls")
    results.add("singleflight", name, "hand-off per caller",
                statistics.median(hand_off for _, hand_off, _ in runs) * 1e6, "us")
    results.add("singleflight", name, "stampede per caller",
                statistics.median(episode for _, _, episode in runs) * 1e6, "us")
    results.add("singleflight", name, "task stampede per caller",
                statistics.median(task_stampede(subject, callers) for _ in runs) * 1e6, "us")
