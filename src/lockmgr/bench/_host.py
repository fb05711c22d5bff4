"""The ``host`` scenario: locks shared by the processes of one host, side by side in one
run. ``lockmgr.host`` (``HostLockManager``; its ``-pure`` row on the pure twin) beside the
file locks people use today (filelock, portalocker and fasteners' ``InterProcessLock``, a
file per key), ``PgLockManager`` on ``--pg-dsn``'s server and the in-process
``LockManager`` (its pair only: it is one process's). Every figure is measured in worker
processes (``host_worker``), each with the engine it names; the table's ratios are each
figure over ``lockmgr.host``'s."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ._measure import percentile, progress

if TYPE_CHECKING:
    from ._measure import Results, Settings

#: What the host table's ratios divide by.
HOST_BASELINE = "lockmgr.host"
#: The rows of the host scenario, in the table's order: name -> (worker backend, pure twin).
HOST_SUBJECTS: dict[str, tuple[str, bool]] = {
    HOST_BASELINE: ("lockmgr.host", False),
    "lockmgr.host-pure": ("lockmgr.host", True),
    "filelock": ("filelock", False),
    "portalocker": ("portalocker", False),
    "fasteners": ("fasteners", False),
    "postgres": ("postgres", False),
    "lockmgr": ("lockmgr", False),
    "lockmgr-pure": ("lockmgr", True),
}
#: The rows that are one process's: only their pairs are measured.
IN_PROCESS = frozenset({"lockmgr", "lockmgr-pure"})
#: The libraries compared, each from the [bench] extra.
FILE_LOCKS = frozenset({"filelock", "portalocker", "fasteners"})

PROCESSES = 4  # one hot key: this many processes
WORK = 50e-6  # busy inside the lock, each grant (hot key, barging)
WAITER_PAUSE = 0.001  # barging: a waiting process's pause before it waits again
PATIENCE = 600.0  # how long a worker may take to answer (a hang bound)


def host_refusal(name: str, pg_dsn: str | None) -> str | None:
    """Why the host row ``name`` cannot be measured here, if it cannot."""
    if name == "postgres" and not pg_dsn:
        return "postgres: left out: give --pg-dsn (a local server) to measure PgLockManager"
    if name in FILE_LOCKS and importlib.util.find_spec(name) is None:
        return f"{name}: left out: not installed (pip install 'lockmgr[bench]')"
    backend, pure = HOST_SUBJECTS[name]
    if backend.startswith("lockmgr") and not pure \
            and importlib.util.find_spec("lockmgr._core") is None:
        return f"{name}: left out: the compiled core is not built"
    return None


class Worker:
    """A ``host_worker`` process: one JSON command, one JSON answer."""

    def __init__(self, name: str, directory: str, pg_dsn: str, namespace: str) -> None:
        backend, pure = HOST_SUBJECTS[name]
        env = dict(os.environ)
        env.pop("LOCKMGR_NO_EXTENSIONS", None)
        if pure:
            env["LOCKMGR_NO_EXTENSIONS"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lockmgr.bench.host_worker", backend, directory, pg_dsn,
             namespace], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            if self.answer() != "ready":
                raise RuntimeError(f"a {name} benchmark worker failed to start")
        except BaseException:
            self.kill()
            raise

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self) -> Any:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a host benchmark worker ended ({self.process.wait()})")
        return json.loads(line)

    def ask(self, **command: Any) -> Any:
        self.send(**command)
        return self.answer()

    def stop(self) -> None:
        """Let it finish (end of its input), or kill it if it does not in time."""
        try:
            self.process.communicate(timeout=PATIENCE)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self.process.kill()
        self.process.communicate()


@contextmanager
def _workers(count: int, name: str, directory: str, pg_dsn: str) -> Iterator[list[Worker]]:
    namespace = f"lockmgr-bench-{os.getpid()}-{time.time()}"
    started: list[Worker] = []
    try:
        for _ in range(count):
            started.append(Worker(name, directory, pg_dsn, namespace))
        yield started
    except BaseException:
        for worker in started:  # perhaps blocked in a wait: nothing to finish
            worker.kill()
        raise
    for worker in started:
        worker.stop()


def host(name: str, pg_dsn: str | None, settings: Settings, results: Results) -> None:
    """Every host figure of the row ``name``, in a lock directory of its own."""
    refusal = host_refusal(name, pg_dsn)
    if refusal:
        results.notes.append(refusal)
        progress(refusal)
        return
    directory = tempfile.mkdtemp(prefix="lockmgr-bench-host-")
    measures = [_pairs] if name in IN_PROCESS else [_pairs, _hot_key, _killed_holder, _barging]
    try:
        for measure in measures:
            try:
                measure(name, directory, pg_dsn or "", settings, results)
            except Exception as error:  # a library that misbehaves: said, the run goes on
                failure = f"{name}: {measure.__name__.strip('_')} failed: {error}"
                results.notes.append(failure)
                progress(failure)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def held_keys(settings: Settings) -> int:
    return int(settings.scaled(1_000, 10_000))


def _pairs(name: str, directory: str, pg_dsn: str, settings: Settings,
           results: Results) -> None:
    held = held_keys(settings)
    with _workers(1, name, directory, pg_dsn) as (worker,):
        found = worker.ask(do="pairs", seconds=settings.scaled(0.02, 0.2), held=held)
    results.add("host", name, "acquire+release, uncontended", found["alone"], "us")
    if "held" in found:
        results.add("host", name, f"acquire+release, {held:,} other keys held",
                    found["held"], "us")
    else:
        results.notes.append(f"{name}: {held:,} keys held: {found['held_error']}")


def _hot_key(name: str, directory: str, pg_dsn: str, settings: Settings,
             results: Results) -> None:
    """``PROCESSES`` processes on one key, each straight back after its release."""
    seconds = settings.scaled(0.5, 3.0)
    found = _loop(name, directory, pg_dsn, seconds, [0.0] * PROCESSES)
    made = sum(answer["pairs"] for answer in found)
    handoffs = [ns / 1e3 for answer in found for ns in answer["handoffs"]]
    results.add("host", name, f"one hot key, {PROCESSES} processes", made / seconds, "pairs/s")
    results.add("host", name, "hand-off to another process, p50", percentile(handoffs, 0.5), "us")
    results.add("host", name, "hand-off to another process, p99", percentile(handoffs, 0.99), "us")


def _barging(name: str, directory: str, pg_dsn: str, settings: Settings,
             results: Results) -> None:
    """One process releases and re-acquires at once, in a loop, while ``PROCESSES - 1``
    others wait (each pausing ``WAITER_PAUSE`` between its grants): how long does a waiting
    process wait (the worst of their p99s), and what share of the grants does the
    re-acquiring one get?"""
    seconds = settings.scaled(0.5, 3.0)
    found = _loop(name, directory, pg_dsn, seconds, [0.0] + [WAITER_PAUSE] * (PROCESSES - 1))
    worst = max(percentile(answer["waits"], 0.99) for answer in found[1:]) / 1e6
    grants = sum(answer["pairs"] for answer in found)
    results.add("host", name, "barging: a waiting process's wait p99 (worst of 3)", worst, "ms")
    results.add("host", name, "barging: grants to the re-acquiring process",
                100 * found[0]["pairs"] / max(1, grants), "%")


def _loop(name: str, directory: str, pg_dsn: str, seconds: float,
          pauses: list[float]) -> list[Any]:
    """Processes looping on the hot key together, one per pause; their answers."""
    stamp = os.path.join(directory, "stamp")
    with open(stamp, "wb") as file:
        file.write(bytes(16))
    with _workers(len(pauses), name, directory, pg_dsn) as workers:
        for worker, pause in zip(workers, pauses):
            worker.send(do="hot", stamp=stamp, seconds=seconds, work=WORK, pause=pause)
        return [worker.answer() for worker in workers]


def _killed_holder(name: str, directory: str, pg_dsn: str, settings: Settings,
                   results: Results) -> None:
    """A holder SIGKILLed while another process waits for its key: from the kill to the
    waiter's acquire returning (ms, the median of 20 rounds; 5 with ``--quick``)."""
    rounds = int(settings.scaled(5, 20))
    took: list[float] = []
    with _workers(2, name, directory, pg_dsn) as (factory, waiter):
        for round_ in range(rounds):
            key = f"killed-{round_}"
            holder = factory.ask(do="spawn-holder", key=key)
            waiter.send(do="wait", key=key)
            if waiter.answer() != "waiting":
                raise RuntimeError("the waiting worker did not start waiting")
            # Into its acquire (a kernel wait, or a poll's sleep), and at a random moment of
            # it: a fixed delay would fall at the same point of every poll interval or slice.
            time.sleep(0.05 + random.uniform(0, 0.05))
            killed = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            os.kill(holder, signal.SIGKILL)
            took.append((waiter.answer() - killed) / 1e6)
    results.add("host", name, "killed holder: key taken by a waiter, p50",
                statistics.median(took), "ms")
