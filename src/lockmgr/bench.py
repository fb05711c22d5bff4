"""``lockmgr-bench``: lockmgr against threading.Lock and friends, side by side in one run.

Run ``lockmgr-bench --quick`` (or ``python -m lockmgr.bench --quick``); ``--help`` lists the
scenarios and options. The table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import importlib
import importlib.util
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
import timeit
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from . import _pure

Key = Any
View = Callable[[Key], AbstractContextManager[Any]]

BASELINE = "threading.Lock"
STRIPES = 1024  # the ``striped`` implementation: LockManager(stripes=1024)
ASKED_FOR_ONLY = frozenset({"lockmgr-logged"})  # run only when named with --impl


@dataclass
class Subject:
    """One implementation, as each scenario drives it."""

    view: View  # key -> a context manager holding that key
    acquire: Callable[[Key], Any]  # lock one key (memory scenario)
    release: Callable[[Key], Any]  # unlock one key (memory scenario)
    pair: tuple[str, dict[str, Any]]  # timeit statement + globals: one acquire + release
    with_block: tuple[str, dict[str, Any]]  # timeit statement + globals: one ``with`` block
    hold: tuple[str, dict[str, Any]] | None = None  # lockmgr's ``with locks.hold(key)``
    per_key_memory: bool = True  # whether memory grows per key (not for one global lock)
    read_view: View | None = None  # key -> a context manager reading it (default: ``view``)
    scenarios: frozenset[str] | None = None  # the only scenarios it runs (None: all)
    #: thread index -> (acquire, release) of that thread's own lock, for ``scaling``: its own
    #: key in the one shared manager, or (threading's locks) a lock of its own
    own_lock: Callable[[int], tuple[Callable[[], Any], Callable[[], Any]]] | None = None


def _own_key(locks: Any) -> Callable[[int], tuple[Callable[[], Any], Callable[[], Any]]]:
    stripes = locks.stripes
    # Striped: thread ``index`` takes a key of stripe ``index`` (two keys of one stripe are
    # one lock, which a hash seed could otherwise give two threads); found here, up front.
    suffixes = [_suffix_on_stripe(locks, index) for index in range(max(scaling_threads()))]

    def own(index: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
        # Bound in the calling thread: without a GIL, threads sharing one bound method (or
        # a closure cell) would contend on its reference count, not on the manager.
        key = f"thread-{index}" if stripes is None else f"thread-{index}-{suffixes[index]}"
        return functools.partial(locks.acquire, key), functools.partial(locks.release, key)

    return own


def _suffix_on_stripe(locks: Any, index: int) -> int | None:
    """The first ``n`` such that ``f"thread-{index}-{n}"`` is on stripe ``index`` (modulo the
    stripe count) of the striped ``locks``; None for an exact manager."""
    if locks.stripes is None:
        return None
    return next(n for n in itertools.count()
                if locks.stripe_of(f"thread-{index}-{n}") == index % locks.stripes)


def _lockmgr(manager_class: Any, **options: Any) -> Callable[[], Subject]:
    def make() -> Subject:
        locks = manager_class(**options)
        names = {"a": locks.acquire, "r": locks.release, "m": locks, "k": "user:42"}
        return Subject(
            view=locks.__getitem__,
            acquire=locks.acquire,
            release=locks.release,
            pair=("a(k); r(k)", names),
            with_block=("with m[k]: pass", names),
            hold=("with m.hold(k): pass", names),
            own_lock=_own_key(locks),
        )

    return make


def _global(lock_class: Callable[[], Any]) -> Callable[[], Subject]:
    def make() -> Subject:
        lock = lock_class()
        names = {"a": lock.acquire, "r": lock.release, "l": lock}
        def own(index: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
            mine = lock_class()  # scaling's reference: one lock per thread, nothing shared
            return mine.acquire, mine.release

        return Subject(view=lambda key: lock, acquire=lambda key: lock.acquire(),
                       release=lambda key: lock.release(), pair=("a(); r()", names),
                       with_block=("with l: pass", names), per_key_memory=False, own_lock=own)

    return make


def _rwlock(manager_class: Any) -> Callable[[], Subject]:
    def make() -> Subject:
        locks = manager_class()
        names = {"a": locks.acquire_write, "r": locks.release_write, "m": locks, "k": "user:42"}
        return Subject(view=locks.write, read_view=locks.read, acquire=locks.acquire_write,
                       release=locks.release_write, pair=("a(k); r(k)", names),
                       with_block=("with m.write(k): pass", names),
                       scenarios=frozenset({"read-mostly"}))

    return make


def _dict_of_locks() -> Subject:
    locks: collections.defaultdict[Key, Any] = collections.defaultdict(threading.Lock)
    names = {"d": locks, "k": "user:42"}
    return Subject(view=locks.__getitem__, acquire=lambda key: locks[key].acquire(),
                   release=lambda key: locks[key].release(),
                   pair=("d[k].acquire(); d[k].release()", names),
                   with_block=("with d[k]: pass", names))


PG_SCENARIOS = frozenset({"hot-key", "many-keys"})


def _postgres(dsn: str) -> Callable[[], Subject]:
    def make() -> Subject:
        from .postgres import PgLockManager

        locks: Any = PgLockManager(dsn, namespace=f"lockmgr-bench-{os.getpid()}-{time.time()}")
        names = {"a": locks.acquire, "r": locks.release, "m": locks, "k": "user:42"}
        return Subject(view=locks.__getitem__, acquire=locks.acquire, release=locks.release,
                       pair=("a(k); r(k)", names), with_block=("with m[k]: pass", names),
                       scenarios=PG_SCENARIOS)

    return make


PG_WORKER = """
import itertools, random, sys, time
from lockmgr.postgres import PgLockManager
dsn, namespace, scenario, keys, index = sys.argv[1:6]
locks = PgLockManager(dsn, namespace=namespace)
rng = random.Random(int(index))
plan = ["hot"] if scenario == "hot-key" else [f"key-{rng.randrange(int(keys))}" for _ in range(4096)]
sys.stdin.readline()
deadline, done = time.monotonic() + float(sys.argv[6]), 0
for key in itertools.cycle(plan):
    if time.monotonic() >= deadline:
        break
    with locks[key]:
        done += 1
print(done, flush=True)
"""


def postgres_processes(dsn: str, scenario: str, settings: Settings, results: Results) -> None:
    """The same scenario with one worker process per thread: contention through the server."""
    seconds = settings.scaled(1.0, 3.0)
    namespace = f"lockmgr-bench-{os.getpid()}-{time.time()}"
    workers = [subprocess.Popen([sys.executable, "-c", PG_WORKER, dsn, namespace, scenario,
                                 str(settings.keys), str(index), str(seconds)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for index in range(settings.threads)]
    time.sleep(0.5)  # let them connect and import before the clock starts
    for worker in workers:
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
    total = sum(int(worker.communicate(timeout=seconds + 60)[0]) for worker in workers)
    results.add(scenario, "postgres-processes", "throughput", total / seconds, "acq/s")


SERVER_WORKER = """
import sys, time
backend, address, namespace, index, seconds = sys.argv[1:6]
keys = [f"{namespace}:{index}:{n}" for n in range(16)]  # this process's own keys
if backend == "postgres":
    from lockmgr.postgres import PgLockManager
    locks = PgLockManager(address, namespace=namespace)
    acquire, release = locks.acquire, locks.release
else:
    import redis
    client = redis.Redis.from_url(address)
    handles = {key: client.lock(key) for key in keys}  # redis-py's Lock: SET NX, Lua release
    acquire = lambda key: handles[key].acquire()
    release = lambda key: handles[key].release()
for key in keys:  # connected, scripts loaded: the clock starts warm
    acquire(key)
    release(key)
print("ready", flush=True)
sys.stdin.readline()
deadline, done = time.monotonic() + float(seconds), 0
while time.monotonic() < deadline:
    for key in keys:
        acquire(key)
        release(key)
    done += len(keys)
print(done, flush=True)
"""


def server_pairs(servers: dict[str, str], settings: Settings, results: Results) -> None:
    """Acquire+release pairs per second through each lock server, side by side: one
    process, then ``--threads`` processes each on its own keys; runs alternate between the
    servers (the median of three, one with ``--quick``) so that both see the same machine."""
    seconds = settings.scaled(0.5, 2.0)
    rounds = 1 if settings.quick else 3
    counts = sorted({1, settings.threads})
    for count in counts:
        measured: dict[str, list[float]] = {name: [] for name in servers}
        for _ in range(rounds):
            for name, address in servers.items():
                progress(f"server-pairs: {name}, {count} process(es)")
                measured[name].append(_pairs_per_second(name, address, count, seconds))
        metric = f"{count}-process" + ("es" if count > 1 else "")
        for name, values in measured.items():
            results.add("server-pairs", name, metric, statistics.median(values), "pairs/s")
        if "postgres" in measured and "redis-py" in measured:
            ratio = statistics.median(measured["postgres"]) / statistics.median(measured["redis-py"])
            results.add("server-pairs", "postgres", f"{metric} vs redis-py", ratio, "x")


def _pairs_per_second(backend: str, address: str, count: int, seconds: float) -> float:
    namespace = f"lockmgr-bench-{os.getpid()}-{time.time()}"
    workers = [subprocess.Popen([sys.executable, "-c", SERVER_WORKER, backend, address,
                                 namespace, str(index), str(seconds)],
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
        return sum(int(worker.communicate(timeout=seconds + 60)[0]) for worker in workers) / seconds
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()



@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM (a job's time limit, ``timeout``, ``kill``) raises
    KeyboardInterrupt in the main thread, as Ctrl-C does, so that what the block started
    (a redis-server, a PostgreSQL server) is stopped by its ``finally`` rather than left
    running. (Not SystemExit: pytest fails the running test on it and goes on, while
    KeyboardInterrupt ends the run and tears the fixtures down.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:  # None: a handler not installed from Python, which is as good as the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


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
        server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                   "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
        yield from _running_redis(server, port)


def _running_redis(server: subprocess.Popen[bytes], port: int) -> Iterator[str]:
    """Wait until ``server`` answers, yield its URL, stop it afterwards."""
    try:
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
        server.terminate()
        server.wait(timeout=30)


def _engine_module() -> Any:
    """The compiled core, or the pure twin where it is not built."""
    try:
        return importlib.import_module("lockmgr._core")
    except ImportError:
        return _pure


def implementations(pg_dsn: str | None = None) -> dict[str, Callable[[], Subject]]:
    found: dict[str, Callable[[], Subject]] = {}
    try:
        compiled = importlib.import_module("lockmgr._core")
    except ImportError:
        print("lockmgr-bench: the compiled core is not built; showing the pure twin only",
              file=sys.stderr)
    else:
        found["lockmgr"] = _lockmgr(compiled.LockManager)
        found["lockmgr-unfair"] = _lockmgr(compiled.LockManager, fair=False)
        found["striped"] = _lockmgr(compiled.LockManager, stripes=STRIPES)
        # The slow-wait log on: what seeing contention costs where nothing waits.
        found["lockmgr-logged"] = _lockmgr(compiled.LockManager, log_waits_after=1.0)
        found["rwlock"] = _rwlock(compiled.RWLockManager)
    found["lockmgr-pure"] = _lockmgr(_pure.LockManager)
    found["rwlock-pure"] = _rwlock(_pure.RWLockManager)
    found["threading.Lock"] = _global(threading.Lock)
    found["threading.RLock"] = _global(threading.RLock)
    found["dict-of-locks"] = _dict_of_locks
    if pg_dsn:
        found["postgres"] = _postgres(pg_dsn)
    return found


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


# -- scenarios -------------------------------------------------------------------------------


def uncontended(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    number = int(settings.scaled(100_000, 1_000_000))
    if name == "lockmgr-pure":
        number //= 10

    def ns(statement: tuple[str, dict[str, Any]]) -> float:
        code, names = statement
        # The names are the timed function's locals, as a program's would be: a global
        # lookup per name costs more than the lock on a free-threaded build.
        setup = "; ".join(f"{name} = _names[{name!r}]" for name in names)
        timings = timeit.repeat(code, setup, globals={"_names": names}, number=number, repeat=5)
        return min(timings) / number * 1e9

    results.add("uncontended", name, "acquire+release", ns(subject.pair), "ns")
    results.add("uncontended", name, "with-block", ns(subject.with_block), "ns")
    if subject.hold is not None:
        results.add("uncontended", name, "with-hold", ns(subject.hold), "ns")


def hot_key(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    lock = subject.view("hot")
    counts = [0] * settings.threads
    last = [-1, 0.0]  # the thread that held the key last, and when it was about to release
    handoffs: list[float] = []

    def body(index: int, stop: threading.Event) -> None:
        done = 0
        while not stop.is_set():
            with lock:
                now = time.perf_counter()
                if last[0] != index and last[0] != -1:
                    handoffs.append(now - last[1])
                last[0] = index
                done += 1
                last[1] = time.perf_counter()
        counts[index] = done

    elapsed = run_for(settings.scaled(1.0, 3.0), settings.threads, body)
    results.add("hot-key", name, "throughput", sum(counts) / elapsed, "acq/s")
    results.add("hot-key", name, "handoff-p50", percentile(handoffs, 0.50) * 1e6, "us")
    results.add("hot-key", name, "handoff-p99", percentile(handoffs, 0.99) * 1e6, "us")


def many_keys(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    counts = [0] * settings.threads
    view = subject.view
    plans = [[f"key-{rng.randrange(settings.keys)}" for _ in range(4096)]
             for rng in map(random.Random, range(settings.threads))]

    def body(index: int, stop: threading.Event) -> None:
        done = 0
        for key in itertools.cycle(plans[index]):
            if stop.is_set():
                break
            with view(key):
                done += 1
        counts[index] = done

    elapsed = run_for(settings.scaled(1.0, 3.0), settings.threads, body)
    results.add("many-keys", name, "throughput", sum(counts) / elapsed, "acq/s")


CREATE_THREADS = 16
GET_SECONDS = 0.010
CREATE_SECONDS = 0.002


def create_if_not_exists(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    """The LockSet article's workload: look an id up (10 ms); create it if missing (2 ms)."""
    lookups = int(settings.scaled(8, 25))
    for pool in (100, 1000):
        wall, wrong = _create_from_pool(subject.view, pool, lookups)
        results.add("create-if-not-exists", name, f"wall-pool{pool}", wall, "s")
        results.add("create-if-not-exists", name, f"not-created-once-pool{pool}", wrong, "ids")


def _create_from_pool(view: View, pool: int, lookups: int) -> tuple[float, int]:
    """One run of the workload on ids from ``pool``: its wall time, and how many ids were
    not created exactly once."""
    rng = random.Random(pool)
    plans = [[rng.randrange(pool) for _ in range(lookups)] for _ in range(CREATE_THREADS)]
    store: dict[int, int] = {}
    creations: collections.Counter[int] = collections.Counter()

    def body(index: int) -> None:
        for natural_id in plans[index]:
            with view(natural_id):
                time.sleep(GET_SECONDS)
                if natural_id not in store:
                    time.sleep(CREATE_SECONDS)
                    creations[natural_id] += 1
                    store[natural_id] = natural_id

    began = time.perf_counter()
    run_threads(CREATE_THREADS, body)
    wall = time.perf_counter() - began
    wanted = {natural_id for plan in plans for natural_id in plan}
    return wall, sum(count != 1 for count in creations.values()) + len(wanted - set(store))


def fairness(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    """Tickets are taken just before acquiring; a grant to a later ticket overtakes."""
    lock = subject.view("fair")
    tickets = itertools.count()
    grants: list[tuple[int, float]] = []  # (ticket, waited seconds), in grant order

    def body(index: int, stop: threading.Event) -> None:
        while not stop.is_set():
            ticket = next(tickets)
            asked = time.perf_counter()
            with lock:
                grants.append((ticket, time.perf_counter() - asked))
                for _ in range(20):  # a little work inside
                    pass

    run_for(settings.scaled(1.0, 3.0), settings.threads, body)
    results.add("fairness", name, "max-overtaken", max_overtaken([t for t, _ in grants]), "times")
    waits = [waited for _, waited in grants]
    results.add("fairness", name, "wait-p50", percentile(waits, 0.50) * 1e3, "ms")
    results.add("fairness", name, "wait-p99", percentile(waits, 0.99) * 1e3, "ms")
    results.add("fairness", name, "wait-max", max(waits, default=0.0) * 1e3, "ms")


def max_overtaken(order: list[int]) -> int:
    """The most grants any request saw go to requests that asked after it (a Fenwick count)."""
    size = max(order, default=-1) + 2
    tree = [0] * (size + 1)
    worst = 0
    for seen, ticket in enumerate(order):
        position, at_or_below = ticket + 1, 0
        while position > 0:
            at_or_below += tree[position]
            position -= position & -position
        worst = max(worst, seen - at_or_below)
        position = ticket + 1
        while position <= size:
            tree[position] += 1
            position += position & -position
    return worst


def memory(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    if not subject.per_key_memory:
        return
    count = int(settings.scaled(100_000, 1_000_000))
    keys = [f"natural-id-{i}" for i in range(count)]  # made before measuring: not counted
    tracemalloc.start()
    try:
        for key in keys[:64]:  # warm-up: per-thread state, spare entries
            subject.acquire(key)
        for key in keys[:64]:
            subject.release(key)
        start = tracemalloc.get_traced_memory()[0]
        for key in keys:
            subject.acquire(key)
        per_key = (tracemalloc.get_traced_memory()[0] - start) / count
        for key in keys:
            subject.release(key)
        for i in range(count):
            subject.acquire(("residue", i))
            subject.release(("residue", i))
        residue = tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
    results.add("memory", name, "bytes-per-held-key", per_key, "B")
    results.add("memory", name, f"residue-after-{2 * count}-keys", residue, "B")


READ_SECONDS = 0.0005  # a read's work inside the lock, off the GIL (say, I/O)
WRITE_SECONDS = 0.0005


def read_mostly(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    """90% reads, 10% writes over 4 hot keys; each holds its key while it sleeps 0.5 ms."""
    counts = [0] * settings.threads
    read_view = subject.read_view or subject.view
    plans = [[(f"key-{rng.randrange(4)}", rng.random() < 0.9) for _ in range(4096)]
             for rng in map(random.Random, range(settings.threads))]

    def body(index: int, stop: threading.Event) -> None:
        done = 0
        for key, reading in itertools.cycle(plans[index]):
            if stop.is_set():
                break
            with (read_view if reading else subject.view)(key):
                time.sleep(READ_SECONDS if reading else WRITE_SECONDS)
            done += 1
        counts[index] = done

    elapsed = run_for(settings.scaled(1.0, 3.0), settings.threads, body)
    results.add("read-mostly", name, "throughput", sum(counts) / elapsed, "ops/s")


def scaling_threads() -> list[int]:
    """1 thread, 2 threads, and as many as there are cores."""
    return sorted({1, 2, os.cpu_count() or 1})


def scaling(name: str, subject: Subject, settings: Settings, results: Results) -> None:
    """Distinct keys per thread: each thread takes and releases its own key of one shared
    manager (its own lock, for threading's locks) as fast as it can, with 1, 2 and cores
    threads. Nothing is contended, so with the GIL off the throughput should grow with the
    threads up to the cores; ``N-vs-1`` is that growth (one ``threading.RLock`` per thread
    shows what the hardware allows). With a GIL it stays near 1x, whatever the lock."""
    if subject.own_lock is None:
        return
    own_lock = subject.own_lock
    seconds = settings.scaled(0.3, 2.0)
    rates: dict[int, float] = {}
    for count in scaling_threads():
        counts = [0] * count

        def body(index: int, stop: threading.Event) -> None:
            acquire, release = own_lock(index)
            done = 0
            while not stop.is_set():
                for _ in range(256):  # a stop check per 256 pairs: the loop is the pair
                    acquire()
                    release()
                done += 256
            counts[index] = done

        elapsed = run_for(seconds, count, body)
        rates[count] = sum(counts) / elapsed
        label = f"{count}-thread" + ("s" if count > 1 else "")
        results.add("scaling", name, label, rates[count], "acq/s")
    for count in scaling_threads()[1:]:
        results.add("scaling", name, f"{count}-vs-1", rates[count] / rates[1], "x")


SCENARIOS: dict[str, Callable[[str, Subject, Settings, Results], None]] = {
    "uncontended": uncontended,
    "hot-key": hot_key,
    "many-keys": many_keys,
    "create-if-not-exists": create_if_not_exists,
    "fairness": fairness,
    "memory": memory,
    "read-mostly": read_mostly,
    "scaling": scaling,
}


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


# -- output ----------------------------------------------------------------------------------


def gil_enabled() -> bool:
    """Whether the GIL is on now (always, on a build that has one)."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def machine() -> dict[str, Any]:
    import lockmgr

    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "free_threaded_build": bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
        "gil_enabled": gil_enabled(),
        "lockmgr_engine": lockmgr.implementation,
        "lockmgr_engine_reason": lockmgr.implementation_reason,
    }


def header(about: dict[str, Any]) -> str:
    """One line on what ran: the figures of a GIL build and of a GIL-off one differ in kind."""
    build = "free-threaded build" if about["free_threaded_build"] else "GIL build"
    return (f"lockmgr-bench: {about['implementation']} {about['python']} ({build}), "
            f"GIL {'on' if about['gil_enabled'] else 'off'}, lockmgr engine "
            f"{about['lockmgr_engine']}, {about['cpu_count']} CPUs, {about['platform']}")


def table(results: Results, impls: list[str], baseline: str = BASELINE,
          scenarios: Iterable[str] | None = None) -> Iterator[str]:
    """A Markdown table: one row per metric (of ``scenarios``, default all), each figure
    with its ratio to ``baseline`` (threading.Lock; asyncio.Lock for the asyncio table)."""
    cells: dict[tuple[str, str], dict[str, Any]] = collections.defaultdict(dict)
    units: dict[tuple[str, str], str] = {}
    wanted = None if scenarios is None else set(scenarios)
    for row in results.rows:
        if wanted is not None and row["scenario"] not in wanted:
            continue
        cells[row["scenario"], row["metric"]][row["impl"]] = row["value"]
        units[row["scenario"], row["metric"]] = row["unit"]
    yield "| scenario | metric | " + " | ".join(impls) + " |"
    yield "|---|---|" + "---|" * len(impls)
    for (scenario, metric), values in cells.items():
        base = values.get(baseline)
        shown = []
        for impl in impls:
            value = values.get(impl)
            if value is None:
                shown.append("—")
                continue
            text = f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
            if base and impl != baseline:
                text += f" ({value / base:.2f}x)"
            shown.append(text)
        yield f"| {scenario} | {metric} ({units[scenario, metric]}) | " + " | ".join(shown) + " |"


# -- pictures (lockmgr[plot]) -------------------------------------------------------------------

#: Units where more is better; in every other unit (ns, us, ms, s, B, times, ids, yes=1) less is.
HIGHER_IS_BETTER = frozenset({"acq/s", "holds/s", "ops/s", "pairs/s", "x", "keys"})


def better(unit: str) -> str:
    return "higher is better" if unit in HIGHER_IS_BETTER else "lower is better"


@dataclass
class Panel:
    """One metric's bars: the implementations that measured it, in the order asked."""

    scenario: str
    metric: str
    unit: str
    values: dict[str, float]
    log: bool  # the values span more than 10x

    @property
    def title(self) -> str:
        return f"{self.scenario}: {self.metric} ({better(self.unit)})"


def panels(results: Results, impls: list[str]) -> list[Panel]:
    """A panel per metric with something to show: all-zero or unmeasured ones are dropped."""
    found = []
    for scenario, metric, unit in dict.fromkeys((row["scenario"], row["metric"], row["unit"])
                                                for row in results.rows):
        measured = {row["impl"]: float(row["value"]) for row in results.rows
                    if row["scenario"] == scenario and row["metric"] == metric}
        values = {impl: measured[impl] for impl in impls if impl in measured}
        positive = [value for value in values.values() if value > 0]
        if not positive:
            continue
        found.append(Panel(scenario, metric, unit, values, max(positive) > 10 * min(positive)))
    return found


def baseline_of(scenario: str) -> str:
    return ASYNC_BASELINE if scenario in ASYNC_SCENARIOS else BASELINE


def ratios(found: list[Panel]) -> list[tuple[Panel, dict[str, float]]]:
    """For the summary panel: each metric's values as ratios to its baseline's
    (threading.Lock; asyncio.Lock for the asyncio scenarios), where it measured one."""
    rows = []
    for panel in found:
        baseline = baseline_of(panel.scenario)
        base = panel.values.get(baseline, 0.0)
        if base <= 0:  # nothing to divide by (asyncio.Lock is never overtaken): no row
            continue
        compared = {impl: value / base for impl, value in panel.values.items()
                    if impl != baseline and value > 0}
        if compared:
            rows.append((panel, compared))
    return rows


def _colour(impl: str) -> str:
    """lockmgr's compiled engine stands out; its other forms in lighter blues; peers grey."""
    if impl == "lockmgr":
        return "#d62728"
    if impl.startswith(("lockmgr", "striped", "rwlock")):
        return "#6baed6"
    return "#9e9e9e"


def plot(results: Results, impls: list[str], path: str) -> None:
    """The results at a glance: first every metric as a ratio to threading.Lock (asyncio
    ones to asyncio.Lock) on one log axis (lockmgr in red), then one panel per metric, log-scaled where values span more
    than 10x; each title says whether higher or lower is better."""
    importlib.import_module("matplotlib").use("Agg")  # an optional extra: untyped on purpose
    plt = importlib.import_module("matplotlib.pyplot")
    no_labels = importlib.import_module("matplotlib.ticker").NullFormatter
    found = panels(results, impls)
    summary = ratios(found)
    columns = 3
    rows = (len(found) + columns - 1) // columns
    summary_height = max(2.5, 0.32 * len(summary) + 1.2) if summary else 0.0
    figure = plt.figure(figsize=(5 * columns, summary_height + 3.0 * rows))
    grid = figure.add_gridspec(rows + (1 if summary else 0), columns,
                               height_ratios=([summary_height] if summary else []) + [3.0] * rows)
    if summary:
        axis = figure.add_subplot(grid[0, :])
        labels = [f"{panel.scenario}: {panel.metric} ({'higher' if panel.unit in HIGHER_IS_BETTER else 'lower'} is better)"
                  for panel, _ in summary]
        shown: set[str] = set()
        for row, (_, values) in enumerate(summary):
            for impl, ratio in values.items():
                axis.scatter([ratio], [row], s=90 if impl == "lockmgr" else 30, color=_colour(impl),
                             zorder=3 if impl == "lockmgr" else 2,
                             label=None if impl in shown else impl)
                shown.add(impl)
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(no_labels())
        axis.set_yticks(range(len(labels)), labels, fontsize=7)
        axis.invert_yaxis()
        axis.set_xlabel(f"ratio to {BASELINE} (asyncio scenarios: to {ASYNC_BASELINE}); "
                        "log scale", fontsize=8)
        axis.set_title("Every scenario against the standard library's lock: lockmgr in red",
                       fontsize=10)
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
        axis.grid(axis="x", which="both", alpha=0.3)
    first_row = 1 if summary else 0
    for index, panel in enumerate(found):
        axis = figure.add_subplot(grid[first_row + index // columns, index % columns])
        names = list(panel.values)
        axis.barh(names, [panel.values[name] for name in names],
                  color=[_colour(name) for name in names])
        if panel.log:
            axis.set_xscale("log")
            axis.xaxis.set_minor_formatter(no_labels())
        for row, name in enumerate(names):
            if panel.values[name] == 0:  # no bar to see: say it
                axis.annotate("0", (0, row), xycoords=("axes fraction", "data"),
                              xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
        axis.set_title(panel.title, fontsize=8)
        axis.set_xlabel(panel.unit + (" (log scale)" if panel.log else ""), fontsize=7)
        axis.tick_params(labelsize=7)
        axis.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


# -- the contention report (--contention-report) ---------------------------------------------------

REPORT_HOLD_SECONDS = 0.0001  # the work each holder does (off the GIL, as I/O would be)
REPORT_SKEW = 1.1  # Zipf exponent of the many-keys run: a few keys draw most requests


def contention_runs(manager_class: Any, settings: Settings) -> dict[str, Any]:
    """The hot-key and (skewed) many-keys workloads on a fresh manager each, with metrics
    on; returns each run's ``metrics()``."""
    seconds = settings.scaled(1.0, 3.0)
    weights = [1 / (rank + 1) ** REPORT_SKEW for rank in range(settings.keys)]
    measured = {}
    for run, pick in (("hot-key", None), ("many-keys (Zipf)", weights)):
        locks = manager_class()
        plans = [["hot"] if pick is None else
                 [f"key-{k}" for k in random.Random(seed).choices(range(settings.keys), pick, k=4096)]
                 for seed in range(settings.threads)]

        def body(index: int, stop: threading.Event, locks: Any = locks,
                 plans: list[list[str]] = plans) -> None:
            for key in itertools.cycle(plans[index]):
                if stop.is_set():
                    break
                with locks[key]:
                    time.sleep(REPORT_HOLD_SECONDS)

        progress(f"contention report: {run}")
        run_for(seconds, settings.threads, body)
        measured[run] = locks.metrics()
    return measured


def _bucket_label(bound: float) -> str:
    if bound < 1e-3:
        return f"{bound * 1e6:.3g}us"
    return f"{bound * 1e3:.3g}ms" if bound < 1 else f"{bound:.3g}s"


def contention_report(measured: dict[str, Any], path: str) -> None:
    """Wait-time and hold-time histograms of each run, and the skewed run's hot keys."""
    importlib.import_module("matplotlib").use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    figure, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    runs = list(measured)
    first = measured[runs[0]]
    labels = [f"<={_bucket_label(bound)}" for bound in first.wait_time.bounds] + [
        f">{_bucket_label(first.wait_time.bounds[-1])}"]
    used = [index for index in range(len(labels))
            if any(m.wait_time.counts[index] or m.hold_time.counts[index] for m in measured.values())]
    lo, hi = (min(used), max(used)) if used else (0, len(labels) - 1)
    shown = range(lo, hi + 1)
    width = 0.8 / len(runs)
    for axis, which, title in ((axes[0], "wait_time", "Wait before the grant"),
                               (axes[1], "hold_time", "Holds someone waited for")):
        if not any(getattr(measured[run], which).count for run in runs):
            axis.text(0.5, 0.5, "nothing waited", ha="center", va="center")
            axis.set_axis_off()
            continue
        for offset, run in enumerate(runs):
            histogram = getattr(measured[run], which)
            axis.bar([position + offset * width for position in range(len(shown))],
                     [histogram.counts[index] for index in shown], width, label=
                     f"{run}: {histogram.count:,} (p50 {_bucket_label(histogram.quantile(0.5) or 0)}, "
                     f"max {_bucket_label(histogram.max)})")
        axis.set_xticks([position + width * (len(runs) - 1) / 2 for position in range(len(shown))],
                        [labels[index] for index in shown], rotation=60, fontsize=7)
        axis.set_yscale("log")
        axis.set_ylabel("count (log scale)", fontsize=8)
        axis.set_title(f"{title} (lower is better)", fontsize=10)
        axis.legend(fontsize=7)
    hot = measured[runs[-1]].hot_keys
    axis = axes[2]
    if hot:
        axis.barh([repr(entry.key) for entry in hot], [entry.waited for entry in hot],
                  color="#d62728")
        axis.invert_yaxis()
        axis.set_xlabel("seconds waited, all threads (Space-Saving; over-estimate <= error)",
                        fontsize=8)
        axis.tick_params(labelsize=7)
    else:
        axis.text(0.5, 0.5, "nothing waited", ha="center", va="center")
        axis.set_axis_off()
    axis.set_title(f"Hot keys of {runs[-1]}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report_lines(measured: dict[str, Any]) -> Iterator[str]:
    for run, metrics in measured.items():
        waits = metrics.wait_time
        if not waits.count:
            yield f"{run}: {metrics.acquisitions:,} acquisitions, none waited"
            continue
        yield (f"{run}: {metrics.acquisitions:,} acquisitions, {metrics.contended:,} waited "
               f"(p50 {_bucket_label(waits.quantile(0.5) or 0)}, p99 "
               f"{_bucket_label(waits.quantile(0.99) or 0)}, max {_bucket_label(waits.max)}); "
               "hot keys: " + ", ".join(f"{entry.key!r} {entry.waited:.2f}s"
                                        for entry in metrics.hot_keys[:5]))


def parse_args(argv: list[str] | None, impl_names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="lockmgr-bench",
        description="Compare lockmgr with threading.Lock and friends on this machine.",
    )
    parser.add_argument("--quick", action="store_true", help="short runs: the whole suite in under a minute")
    parser.add_argument("--scenario", action="append",
                        choices=[*SCENARIOS, *ASYNC_SCENARIOS, "server-pairs", "distributed"],
                        help="run only this scenario (repeatable; default: all but "
                             "distributed, which runs only when named: it needs --pg-dsn, "
                             "--redis and lockmgr[compare])")
    parser.add_argument("--impl", action="append", choices=impl_names,
                        help="run only this implementation (repeatable; default: all)")
    parser.add_argument("--threads", type=_positive, default=4, help="threads for hot-key, many-keys and fairness (default 4; scaling uses 1, 2 and the CPU count)")
    parser.add_argument("--keys", type=_positive, default=1000, help="distinct keys for many-keys (default 1000)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--plot", metavar="PATH.png", help="also draw the results (needs lockmgr[plot])")
    parser.add_argument("--contention-report", metavar="PATH.png",
                        help="instead of the scenarios: run hot-key and a skewed many-keys "
                             "with lockmgr's metrics on and draw the wait-time histograms and "
                             "the hot keys (needs lockmgr[plot])")
    parser.add_argument("--pg-dsn", metavar="DSN",
                        help="add PostgreSQL (lockmgr[postgres]) to hot-key and many-keys: "
                             "threads of one process, and one process per thread; and to "
                             "server-pairs; distributed takes it as a postgresql:// URL (the "
                             "form tooz reads)")
    parser.add_argument("--redis", metavar="URL|start",
                        help="server-pairs beside redis-py's Lock, and distributed beside the "
                             "Redis locks, on this Redis server ('start': a throwaway "
                             "redis-server on 127.0.0.1)")
    return parser.parse_args(argv)


#: What ``--scenario distributed`` imports beside lockmgr (module: the package bringing it),
#: all in ``lockmgr[compare]``.
COMPARE_MODULES = {"psycopg": "psycopg", "redis": "redis", "redis_lock": "python-redis-lock",
                   "pottery": "pottery", "tooz": "tooz", "psycopg2": "psycopg2-binary"}


def distributed_refusal(pg_dsn: str | None, redis: str | None) -> str | None:
    """Why ``--scenario distributed`` cannot run with these options here, if it cannot."""
    if not (pg_dsn and redis):
        return "distributed needs --pg-dsn and --redis"
    if not pg_dsn.startswith(("postgresql://", "postgres://")):
        return "distributed needs --pg-dsn as a postgresql:// URL (the form tooz reads)"
    missing = [package for module, package in COMPARE_MODULES.items()
               if importlib.util.find_spec(module) is None]
    if missing:
        return (f"distributed needs lockmgr[compare] ({', '.join(missing)} missing here): "
                "pip install 'lockmgr[compare]'")
    return None


def _option(argv: list[str], name: str) -> str | None:
    """An option's value before argparse runs (it decides which implementations exist)."""
    for index, argument in enumerate(argv):
        if argument == name and index + 1 < len(argv):
            return argv[index + 1]
        if argument.startswith(name + "="):
            return argument.split("=", 1)[1]
    return None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def main(argv: list[str] | None = None) -> int:
    pg_dsn = _option(argv if argv is not None else sys.argv[1:], "--pg-dsn")
    available = implementations(pg_dsn)
    async_available = async_implementations()
    args = parse_args(argv, list(dict.fromkeys([*available, *async_available])))
    drawing = args.plot or args.contention_report
    if drawing and importlib.util.find_spec("matplotlib") is None:
        option = "--plot" if args.plot else "--contention-report"
        print(f"lockmgr-bench: {option} needs matplotlib: pip install 'lockmgr[plot]'",
              file=sys.stderr)
        return 2
    if args.redis and importlib.util.find_spec("redis") is None:
        print("lockmgr-bench: --redis needs redis-py: pip install 'lockmgr[bench]'",
              file=sys.stderr)
        return 2
    impls = args.impl or [name for name in dict.fromkeys([*available, *async_available])
                           if name not in ASKED_FOR_ONLY]
    settings = Settings(quick=args.quick, threads=args.threads, keys=args.keys)
    if args.contention_report:
        report = contention_runs(_engine_module().LockManager, settings)
        print(header(machine()))
        print("\n".join(report_lines(report)))
        contention_report(report, args.contention_report)
        progress(f"wrote {args.contention_report}")
        return 0
    results = Results()
    servers = args.pg_dsn or args.redis
    for scenario in args.scenario or [*SCENARIOS, *(["server-pairs"] if servers else []),
                                      *ASYNC_SCENARIOS]:
        if scenario == "server-pairs":
            with contextlib.ExitStack() as stack:
                named = {"postgres": args.pg_dsn} if args.pg_dsn else {}
                if args.redis:
                    named["redis-py"] = stack.enter_context(redis_server(args.redis))
                if not named:
                    print("lockmgr-bench: server-pairs needs --pg-dsn or --redis (or both)",
                          file=sys.stderr)
                    return 2
                server_pairs(named, settings, results)
            continue
        if scenario == "distributed":
            refusal = distributed_refusal(args.pg_dsn, args.redis)
            if refusal:
                print(f"lockmgr-bench: {refusal}", file=sys.stderr)
                return 2
            from ._distributed_bench import distributed

            with redis_server(args.redis) as redis_url:
                distributed(args.pg_dsn, redis_url, settings, results)
            continue
        if scenario in ASYNC_SCENARIOS:
            for name in impls:
                if name in async_available:
                    progress(f"{scenario}: {name}")
                    ASYNC_SCENARIOS[scenario](name, async_available[name](), settings, results)
            continue
        for name in impls:
            if name not in available:
                continue
            subject = available[name]()
            if subject.scenarios is not None and scenario not in subject.scenarios:
                continue
            progress(f"{scenario}: {name}")
            SCENARIOS[scenario](name, subject, settings, results)
        if args.pg_dsn and scenario in PG_SCENARIOS:
            progress(f"{scenario}: postgres-processes")
            postgres_processes(args.pg_dsn, scenario, settings, results)
    about = machine()  # after the runs: whether something they imported turned the GIL on
    print(header(about))
    # Up to three tables: the thread scenarios (ratios to threading.Lock), the asyncio ones
    # (ratios to one asyncio.Lock), and the distributed one (ratios to lockmgr over
    # PostgreSQL), each with the implementations it measured as columns.
    for scenarios, baseline in ((set(SCENARIOS) | {"server-pairs"}, BASELINE),
                                (set(ASYNC_SCENARIOS), ASYNC_BASELINE),
                                ({"distributed"}, "lockmgr")):
        rows = [row for row in results.rows if row["scenario"] in scenarios]
        if not rows:
            continue
        measured = {row["impl"] for row in rows}  # with postgres-processes, redis-py
        columns = [name for name in dict.fromkeys([*impls, *(row["impl"] for row in rows)])
                   if name in measured]
        print()
        print("\n".join(table(results, columns, baseline, scenarios)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"machine": about, "results": results.rows}, out, indent=2)
        progress(f"wrote {args.json}")
    if args.plot:
        measured = {row["impl"] for row in results.rows}
        plot(results, [name for name in dict.fromkeys([*impls, *(row["impl"] for row in results.rows)])
                       if name in measured], args.plot)
        progress(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
