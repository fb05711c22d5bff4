"""Lock servers in processes of their own: PostgreSQL's scenarios with one worker process per
thread, acquire+release pairs through each server (``server-pairs``), and the Redis server
``--redis start`` runs. The workers are the modules ``pg_worker`` and ``server_worker``."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .._signals import sigterm_interrupts
from ._measure import progress

if TYPE_CHECKING:
    from ._measure import Results, Settings


def postgres_processes(dsn: str, scenario: str, settings: Settings, results: Results) -> None:
    """The same scenario with one worker process per thread: contention through the server."""
    seconds = settings.scaled(1.0, 3.0)
    namespace = f"lockmgr-bench-{os.getpid()}-{time.time()}"
    workers = [subprocess.Popen([sys.executable, "-m", "lockmgr.bench.pg_worker", dsn, namespace,
                                 scenario, str(settings.keys), str(index), str(seconds)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for index in range(settings.threads)]
    time.sleep(0.5)  # let them connect and import before the clock starts
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    total = sum(int(worker.communicate(timeout=seconds + 60)[0]) for worker in workers)
    results.add(scenario, "postgres-processes", "throughput", total / seconds, "acq/s")


#: What ``server-pairs`` compares every pair with: the two prepared statements through
#: ``psycopg.pq`` in a bare loop, the least a pair through PostgreSQL costs from Python.
PAIRS_BASELINE = "libpq"
#: Beside lockmgr (``postgres``), with ``--pg-dsn``: the same advisory locks in bare loops.
PG_FLOORS = ("psycopg", PAIRS_BASELINE)


def server_pairs(servers: dict[str, str], settings: Settings, results: Results) -> None:
    """Acquire+release pairs per second through each lock server, side by side, and the
    client CPU each pair cost (the worker processes' CPU time over their pairs): one
    process, then ``--threads`` processes each on its own keys; runs alternate between the
    servers (the median of three, one with ``--quick``) so that all see the same machine.
    ``postgres`` (lockmgr) comes with its floors, bare psycopg and libpq loops on the same
    server (``PG_FLOORS``)."""
    if "postgres" in servers:  # its floors beside it, before the other servers
        servers = {"postgres": servers["postgres"],
                   **{floor: servers["postgres"] for floor in PG_FLOORS}, **servers}
    seconds = settings.scaled(0.5, 2.0)
    rounds = 1 if settings.quick else 3
    counts = sorted({1, settings.threads})
    for count in counts:
        rates: dict[str, list[float]] = {name: [] for name in servers}
        costs: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(rounds):
            for name, address in servers.items():
                progress(f"server-pairs: {name}, {count} process(es)")
                pairs, cpu = _pairs_and_cpu(name, address, count, seconds)
                rates[name].append(pairs / seconds)
                costs[name].append(cpu / pairs * 1e6)
        metric = f"{count}-process" + ("es" if count > 1 else "")
        for name in servers:
            results.add("server-pairs", name, metric, statistics.median(rates[name]), "pairs/s")
        for name in servers:
            results.add("server-pairs", name, f"{metric} client CPU per pair",
                        statistics.median(costs[name]), "us")
        if "postgres" in rates and "redis-py" in rates:
            ratio = statistics.median(rates["postgres"]) / statistics.median(rates["redis-py"])
            results.add("server-pairs", "postgres", f"{metric} vs redis-py", ratio, "x")


def _pairs_and_cpu(backend: str, address: str, count: int, seconds: float) -> tuple[int, float]:
    """The pairs ``count`` worker processes made in ``seconds``, and the CPU seconds they
    used meanwhile."""
    namespace = f"lockmgr-bench-{os.getpid()}-{time.time()}"
    workers = [subprocess.Popen([sys.executable, "-m", "lockmgr.bench.server_worker", backend,
                                 address, namespace, str(index), str(seconds)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for index in range(count)]
    try:
        for worker in workers:  # all connected and warm before any starts
            assert worker.stdout is not None
            if worker.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a {backend} benchmark worker failed to start")
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write("go\n")
            worker.stdin.flush()
        pairs, cpu = 0, 0.0
        for worker in workers:
            done, used = worker.communicate(timeout=seconds + 60)[0].split()
            pairs, cpu = pairs + int(done), cpu + float(used)
        return pairs, cpu
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()


@contextlib.contextmanager
def redis_server(option: str) -> Iterator[str]:
    """``--redis URL`` takes that server; ``--redis start`` starts Debian's redis-server on
    127.0.0.1 and a free port (no persistence) for the run and stops it afterwards."""
    if option != "start":
        yield option
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("lockmgr-bench: --redis start needs redis-server (Debian: apt-get install redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with sigterm_interrupts():
        yield from _running_redis(
            lambda: subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                      "", "--appendonly", "no"], stdout=subprocess.DEVNULL), port)


def _running_redis(start: Callable[[], subprocess.Popen[bytes]], port: int) -> Iterator[str]:
    """Start the server, wait until it answers, yield its URL, stop it afterwards. A SIGTERM
    while it starts is held until ``start()`` has returned: raised inside Popen, after the
    fork and before Popen returns, it would leave the server running with nothing to stop
    it by."""
    server = None
    held: list[int] = []
    holding = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: held.append(signum)) \
        if holding else None
    try:
        try:
            server = start()
        finally:
            if holding:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        if held:
            raise KeyboardInterrupt(f"signal {held[0]}")
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as probe:
                    probe.sendall(b"PING\r\n")
                    if probe.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
