"""What every scenario shares: the settings, the results, progress lines and the timing
helpers."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO


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
    #: What a table leaves out, and why (printed under the tables).
    notes: list[str] = field(default_factory=list)

    def add(self, scenario: str, impl: str, metric: str, value: float, unit: str) -> None:
        self.rows.append({"scenario": scenario, "impl": impl, "metric": metric,
                          "value": value, "unit": unit})


def progress(message: str) -> None:
    """A line on stderr that the run's reader needs (a file written, something missing)."""
    Progress.clear_line()
    print(f"[lockmgr-bench] {message}", file=sys.stderr, flush=True)


class Progress:
    """Which step of how many a run is at, and how long it has run. On a terminal, one line on
    stderr rewritten in place; elsewhere (a log, a pipe, CI), a line per step as it starts,
    with the time the run had taken by then, and a last one with the total, as pip does."""

    _shown = False  # a status line is on the terminal, not yet ended

    def __init__(self, total: int, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.started = time.monotonic()
        self.done = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.live:
            if Progress._shown:
                self.stream.write("\n")
                self.stream.flush()
                Progress._shown = False
        elif exc_info[0] is None:
            self._line(f"{self.done} steps in {self._elapsed()}")

    def step(self, label: str) -> None:
        """Starting step ``label``, the next of ``total``."""
        self.done += 1
        text = f"{self.done}/{self.total} {label} ({self._elapsed()})"
        if not self.live:
            self._line(text)
            return
        width = shutil.get_terminal_size().columns - 1
        self.stream.write("\r\x1b[K" + f"[lockmgr-bench] {text}"[:width])
        self.stream.flush()
        Progress._shown = True

    def _elapsed(self) -> str:
        """The time since the run started, as m:ss."""
        elapsed = int(time.monotonic() - self.started)
        return f"{elapsed // 60}:{elapsed % 60:02d}"

    def _line(self, text: str) -> None:
        self.stream.write(f"[lockmgr-bench] {text}\n")
        self.stream.flush()

    @staticmethod
    def clear_line() -> None:
        """End a status line on the terminal before a line of its own is printed."""
        if Progress._shown:
            sys.stderr.write("\r\x1b[K")
            Progress._shown = False


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
