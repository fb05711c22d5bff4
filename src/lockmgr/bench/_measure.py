"""What every scenario shares: the settings, the results, progress lines and the timing
helpers."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Settings:
    quick: bool
    threads: int
    keys: int

    def scaled(self, quick: float, full: float) -> float:
        return quick if self.quick else full


@dataclass
class Results:
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(self, scenario: str, impl: str, metric: str, value: float, unit: str) -> None:
        self.rows.append({"scenario": scenario, "impl": impl, "metric": metric,
                          "value": value, "unit": unit})


def progress(message: str) -> None:
    print(f"[lockmgr-bench] {message}", file=sys.stderr, flush=True)


def run_threads(count: int, body: Callable[[int], None]) -> None:
    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def run_for(seconds: float, threads: int, body: Callable[[int, threading.Event], None]) -> float:
    """Run ``body(index, stop)`` in ``threads`` threads started together, set ``stop`` after
    ``seconds`` and wait for them; returns how long they ran."""
    stop = threading.Event()
    start = threading.Barrier(threads + 1)

    def run(index: int) -> None:
        start.wait()
        body(index, stop)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    start.wait()
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return time.perf_counter() - began


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# -- output ----------------------------------------------------------------------------------


def gil_enabled() -> bool:
    """Whether the GIL is on now (always, on a build that has one)."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())
