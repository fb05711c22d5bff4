"""The thread scenarios and what they measure: lockmgr's managers, ``threading.Lock`` and
friends, and PostgreSQL (``--pg-dsn``) as subjects."""

from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import os
import random
import sys
import threading
import time
import timeit
import tracemalloc
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _pure
from ._measure import percentile, run_for, run_threads

if TYPE_CHECKING:
    from ._measure import Results, Settings

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
        from ..postgres import PgLockManager

        locks: Any = PgLockManager(dsn, namespace=f"lockmgr-bench-{os.getpid()}-{time.time()}")
        names = {"a": locks.acquire, "r": locks.release, "m": locks, "k": "user:42"}
        return Subject(view=locks.__getitem__, acquire=locks.acquire, release=locks.release,
                       pair=("a(k); r(k)", names), with_block=("with m[k]: pass", names),
                       scenarios=PG_SCENARIOS)

    return make


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
