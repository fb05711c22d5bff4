"""How long waits take where only a bound is asserted in tests/: a Ctrl-C ending a blocking
wait, and a writer getting in amid a stream of readers. Both engines.

Run: pip install -e '.[bench]' && pytest benchmarks --benchmark-group-by=group
(the unit tests keep generous bounds a loaded machine cannot break; the medians are here)
"""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import threading
import time

import pytest

ENGINES = ["lockmgr._core", "lockmgr._pure"]

WAITING_CHILD = """
import signal, sys, threading
from {module} import LockManager
signal.signal(signal.SIGINT, signal.default_int_handler)
locks = LockManager()
held = threading.Event()
def holder():
    locks.acquire("k")
    held.set()
    threading.Event().wait()
threading.Thread(target=holder, daemon=True).start()
held.wait()
def report_queued():
    while locks.stats().waiting != 1:
        pass
    print("queued", flush=True)
threading.Thread(target=report_queued, daemon=True).start()
try:
    locks.acquire("k")
    print("acquired", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.fixture(params=ENGINES, ids=["cython", "python"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or sys.platform == "win32", reason="POSIX")
@pytest.mark.benchmark(group="Ctrl-C ends a blocking wait")
def test_ctrl_c_latency(benchmark, engine) -> None:  # type: ignore[no-untyped-def]
    """From SIGINT sent to the interrupted main thread's report (the main thread wakes every
    MAIN_THREAD_SLICE to run handlers, so this is at most about 50 ms)."""
    children: list[subprocess.Popen[str]] = []

    def start() -> tuple[tuple[subprocess.Popen[str]], dict[str, object]]:
        child = subprocess.Popen([sys.executable, "-c", WAITING_CHILD.format(module=engine)],
                                 stdout=subprocess.PIPE, text=True)
        children.append(child)
        assert child.stdout is not None and child.stdout.readline() == "queued\n"
        return (child,), {}

    def interrupt(child: subprocess.Popen[str]) -> None:
        child.send_signal(signal.SIGINT)
        assert child.stdout is not None and child.stdout.readline() == "interrupted\n"

    try:
        benchmark.pedantic(interrupt, setup=start, rounds=5, iterations=1)
    finally:
        for child in children:
            child.kill()
            child.communicate()  # reaps it and closes its pipe


@pytest.mark.benchmark(group="writer amid a stream of readers")
def test_writer_wait_amid_readers(benchmark, engine) -> None:  # type: ignore[no-untyped-def]
    """6 reader threads each hold the key ~1 ms in a loop; a writer gets in once the readers
    already in leave (no starvation): a few milliseconds."""
    rw = importlib.import_module(engine).RWLockManager()
    stop = threading.Event()
    reads = [0] * 6

    def reader(index: int) -> None:
        while not stop.is_set():
            with rw.read("k"):
                reads[index] += 1
                time.sleep(0.001)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()

    def write() -> None:
        with rw.write("k", timeout=10):
            pass

    def readers_back_in() -> None:  # untimed: before each round
        time.sleep(0.005)

    try:
        while not all(reads):
            time.sleep(0.001)
        benchmark.pedantic(write, setup=readers_back_in, rounds=10, iterations=1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
