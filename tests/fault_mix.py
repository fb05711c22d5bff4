"""The stress mix under fault injection (issue 11), run as a script in its own interpreter.

    python tests/fault_mix.py lockmgr._core [--unfair] [--threads 5] [--ops 120] [--seed 1]

Threads (the main thread among them) run test_stress's mix: singles, sets, reads, upgrades,
stripes, timeouts, opposite-order pairs that deadlock, and threads that end holding keys.
Meanwhile code runs *inside* their lock calls and waits and calls the managers again:

- ``gc.callbacks`` with ``gc.set_threshold(1)``: a collection at (nearly) every allocation,
  in every thread; every few collections the callback takes keys (try-locks, short waits,
  re-entry), checks exclusion, releases them, and calls ``release_all()``;
- SIGUSR1 sent to the main thread from a timer thread every few milliseconds: the handler
  does the same, plus a wait that must be refused with NestedWaitError when it runs inside
  a wait of the main thread.

Every critical section records who is inside (mutual exclusion, reads vs writes) and the
mix's write sections do a read-yield-write increment (lost updates). Every acquisition,
timeout and DeadlockError is counted where it happens. At the end (all threads joined) it
prints one JSON report; the caller checks it (``tests/stress/test_fault_injection.py``), and the
exit status is 0 unless the script itself broke.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import importlib
import json
import logging
import random
import signal
import sys
import threading
import time
import traceback
import warnings

parser = argparse.ArgumentParser()
parser.add_argument("engine")
parser.add_argument("--unfair", action="store_true")
parser.add_argument("--threads", type=int, default=5)
parser.add_argument("--ops", type=int, default=120)
parser.add_argument("--seed", type=int, default=1)
parser.add_argument("--hang", type=float, default=150.0, help="dump stacks and exit after this")
parser.add_argument("--signal-every", type=float, default=0.004,
                    help="mean seconds between signals")
parser.add_argument("--gc-every", type=int, default=40, help="act on every Nth collection")
args = parser.parse_args()

faulthandler.enable()
faulthandler.dump_traceback_later(args.hang, exit=True)
impl = importlib.import_module(args.engine)
from lockmgr import (  # noqa: E402
    AbandonedLockWarning,
    DeadlockError,
    LockTimeout,
    NestedWaitError,
)

warnings.simplefilter("ignore", AbandonedLockWarning)

KEYS = ["a", "b", "c", "d", 1, 2]
MAIN = threading.get_ident()

# The slow-wait log on (into a NullHandler): its snapshots and records are built in waits.
logging.getLogger("lockmgr").addHandler(logging.NullHandler())
logging.getLogger("lockmgr").propagate = False
logging.getLogger("lockmgr").setLevel(logging.INFO)
locks = impl.LockManager(fair=not args.unfair, log_waits_after=0.002)
rw = impl.RWLockManager(log_waits_after=0.002)
striped = impl.LockManager(stripes=4)
side = impl.LockManager()  # what handlers and finalizers take and release_all() inside waits
MANAGERS = {"locks": locks, "rw": rw, "striped": striped, "side": side}

# -- accounting: per thread and per context (mix / handler / gc), so no += is ever shared ---

_counters: list[collections.Counter[str]] = []
_local = threading.local()


def counter(context: str) -> collections.Counter[str]:
    mine = getattr(_local, context, None)
    if mine is None:
        mine = collections.Counter()
        _counters.append(mine)
        setattr(_local, context, mine)
    return mine


def lock_keys(name: str, keys: list[object]) -> list[object]:
    """The distinct table keys a call on manager ``name`` takes (stripes for ``striped``)."""
    manager = MANAGERS[name]
    return list(dict.fromkeys(manager._table_key(key) for key in keys))


# Who is inside a critical section: (manager, table key) -> idents; list.append/remove are
# atomic, so a handler nesting in its own thread never corrupts the record. The lists are
# made by dict.setdefault, atomic too: a defaultdict's factory may start a collection whose
# callbacks let another thread in, which then installs its own list for the same slot, and
# one of the two lists (with a reader in it) is overwritten.
writers: dict[tuple[str, object], list[int]] = {}
readers: dict[tuple[str, object], list[int]] = {}
values: collections.Counter[tuple[str, object]] = collections.Counter()  # mix increments only
violations: list[str] = []


def inside(table: dict[tuple[str, object], list[int]], slot: tuple[str, object]) -> list[int]:
    return table.setdefault(slot, [])


def enter(name: str, keys: list[object], mode: str, context: str) -> None:
    me = threading.get_ident()
    for key in keys:
        slot = (name, key)
        inside(writers if mode == "w" else readers, slot).append(me)
        others_writing = [i for i in inside(writers, slot) if i != me]
        others_reading = [i for i in inside(readers, slot) if i != me] if mode == "w" else []
        if others_writing or others_reading:
            violations.append(f"{context}: {mode} {slot!r} with others inside")
    if mode == "w" and context == "mix":
        for key in keys:  # read, let others run, write: a second writer would lose an update
            slot = (name, key)
            value = values[slot]
            time.sleep(0)
            values[slot] = value + 1
            counter("mix")[f"inc:{name}:{key!r}"] += 1


def leave(name: str, keys: list[object], mode: str) -> None:
    me = threading.get_ident()
    for key in keys:
        inside(writers if mode == "w" else readers, (name, key)).remove(me)


def granted(name: str, keys: list[object], context: str) -> None:
    counter(context)[f"acq:{name}"] += len(keys)


def timed_out(name: str, context: str) -> None:
    counter(context)[f"timeouts:{name}"] += 1


def refused(name: str, context: str) -> None:
    counter(context)[f"deadlocks:{name}"] += 1


# -- the mix (test_stress's, with exclusion checks and counting) ----------------------------


def single(rng: random.Random, keys: list[object]) -> None:
    key, ctx = keys[0], "mix"
    if locks.acquire(key, timeout=rng.choice([0, 0.002, 0.01])):
        granted("locks", [key], ctx)
        enter("locks", [key], "w", ctx)
        leave("locks", [key], "w")
        locks.release(key)
    else:
        timed_out("locks", ctx)


def many(rng: random.Random, keys: list[object]) -> None:
    ctx = "mix"
    if locks.acquire_many(keys, timeout=rng.choice([0, 0.001, 0.01])):
        granted("locks", keys, ctx)
        enter("locks", keys, "w", ctx)
        leave("locks", keys, "w")
        locks.release_many(keys)
    else:
        timed_out("locks", ctx)


def pair_in_order(rng: random.Random, keys: list[object]) -> None:
    """Two keys one after the other: opposite orders in two threads deadlock."""
    ctx = "mix"
    first, second = (keys + keys)[:2]
    if first == second:
        return single(rng, keys)
    if not locks.acquire(first, timeout=0.01):
        return timed_out("locks", ctx)
    granted("locks", [first], ctx)
    try:
        if locks.acquire(second, timeout=0.05):
            granted("locks", [second], ctx)
            enter("locks", [first, second], "w", ctx)
            leave("locks", [first, second], "w")
            locks.release(second)
        else:
            timed_out("locks", ctx)
    except DeadlockError:
        refused("locks", ctx)
    finally:
        locks.release(first)


def read_then_upgrade(rng: random.Random, keys: list[object]) -> None:
    key, ctx = keys[0], "mix"
    if not rw.acquire_read(key, timeout=0.002):
        return timed_out("rw", ctx)
    granted("rw", [key], ctx)
    enter("rw", [key], "r", ctx)
    try:
        if rng.random() < 0.5:
            if rw.acquire_write(key, timeout=0.002):
                granted("rw", [key], ctx)
                enter("rw", [key], "w", ctx)
                leave("rw", [key], "w")
                rw.release_write(key)
            else:
                timed_out("rw", ctx)
    except DeadlockError:  # two readers upgrading at once
        refused("rw", ctx)
    finally:
        leave("rw", [key], "r")
        rw.release_read(key)


def rw_set(rng: random.Random, keys: list[object]) -> None:
    ctx = "mix"
    reads, writes = keys[:1], keys[1:]
    if rw.acquire_many(reads=reads, writes=writes, timeout=0.002):
        granted("rw", keys, ctx)
        enter("rw", reads, "r", ctx)
        enter("rw", writes, "w", ctx)
        leave("rw", writes, "w")
        leave("rw", reads, "r")
        rw.release_many(reads=reads, writes=writes)
    else:
        timed_out("rw", ctx)


def stripes(rng: random.Random, keys: list[object]) -> None:
    ctx = "mix"
    taken = lock_keys("striped", keys)
    try:
        with striped.hold_many(keys, timeout=0.01):
            granted("striped", taken, ctx)
            enter("striped", taken, "w", ctx)
            leave("striped", taken, "w")
    except LockTimeout:
        timed_out("striped", ctx)


MIX = [single, many, pair_in_order, read_then_upgrade, rw_set, stripes]
OPERATION_MANAGER = {single: "locks", many: "locks", pair_in_order: "locks",
                     read_then_upgrade: "rw", rw_set: "rw", stripes: "striped"}


def body(index: int) -> None:
    rng = random.Random(args.seed * 1000 + index)
    for op in range(args.ops):
        if index == 0 and op % 10 == 0:
            # The main thread waits for "probe" (held by the prober all along): the signal
            # handlers that land in this wait must get NestedWaitError for their probes.
            if locks.acquire("probe", timeout=0.02):
                raise AssertionError("took the probe key held by another thread")
            timed_out("locks", "mix")
        if FREE_THREADED and op % 5 == 0:
            # A free-threaded build's collector ignores a threshold of 1 while many objects
            # live: collect by hand, so the gc callbacks still run in the middle of the mix.
            gc.collect(0)
        keys = rng.sample(KEYS, rng.randint(1, 3))
        operation = rng.choice(MIX)
        try:
            operation(rng, keys)
        except DeadlockError:  # a cycle through a holder that meddles inside a wait
            refused(OPERATION_MANAGER[operation], "mix")
    if index % 3 == 1:  # ends holding a key: thread exit releases it
        if locks.acquire(("abandoned", index), timeout=10):
            granted("locks", [("abandoned", index)], "mix")
        else:
            timed_out("locks", "mix")


# -- faults: code that runs inside lock calls and waits --------------------------------------

_busy = threading.local()
FREE_THREADED = not getattr(sys, "_is_gil_enabled", lambda: True)()


def meddle(context: str, rng: random.Random, nested_probe: bool) -> None:
    """What a handler or finalizer does: take keys (at once, re-entering, try-lock, short
    waits), check exclusion, give them back, release_all() on ``side``."""
    tally = counter(context)
    key = rng.choice(KEYS)
    seconds = rng.choice([0, 0.001, 0.005])
    try:
        if locks.acquire(key, timeout=seconds):
            granted("locks", [key], context)
            enter("locks", [key], "w", context)
            leave("locks", [key], "w")
            locks.release(key)
            tally["meddle:took"] += 1
        else:
            timed_out("locks", context)
            tally["meddle:timeout"] += 1
    except NestedWaitError:
        tally["meddle:nested"] += 1
    except DeadlockError:
        refused("locks", context)
    for side_key in rng.sample(KEYS, 2):
        try:
            if side.acquire(side_key, timeout=0.001):
                granted("side", [side_key], context)
            else:
                timed_out("side", context)
        except NestedWaitError:
            tally["meddle:nested"] += 1
        except DeadlockError:
            # Two meddlers, each holding a side key and waiting for the other's: with the GIL
            # off, finalizers and handlers of different threads really run at once.
            refused("side", context)
    side.release_all()
    observe(rng.choice(list(MANAGERS.values())), tally)
    if nested_probe:
        # A key the meddler itself holds from another thread's point of view: "probe" is
        # held by the prober thread for the whole run, so this always has to wait.
        try:
            if locks.acquire("probe", timeout=0.002):
                raise AssertionError("took the probe key held by another thread")
            timed_out("locks", context)
            tally["probe:waited"] += 1
        except NestedWaitError:
            tally["probe:nested"] += 1
        except DeadlockError:
            refused("locks", context)


def observe(manager: object, tally: collections.Counter[str]) -> None:
    """snapshot() and metrics() from inside lock calls and waits: every key shown is held
    or waited on, by at most one writer; the histogram counts what stats() counts."""
    for state in manager.snapshot():  # type: ignore[attr-defined]
        if not (state.holders or state.waiters) or sum(
                holder.mode == "write" for holder in state.holders) > 1:
            violations.append(f"an impossible snapshot: {state!r}")
    metrics = manager.metrics()  # type: ignore[attr-defined]
    if len(metrics.hot_keys) > 10 or metrics.wait_time.count > metrics.contended:
        violations.append(f"impossible metrics: {metrics!r}")
    tally["meddle:observed"] += 1


def on_signal(signum: int, frame: object) -> None:
    if getattr(_busy, "handler", False):
        return
    _busy.handler = True
    try:
        counter("handler")["signals"] += 1
        meddle("handler", random.Random(), nested_probe=True)
    finally:
        _busy.handler = False


_collections = [0]


def on_collection(phase: str, info: dict[str, int]) -> None:
    if phase != "start" or getattr(_busy, "gc", False):
        return
    _collections[0] += 1
    if _collections[0] % args.gc_every and not FREE_THREADED:  # there, every one is by hand
        return
    _busy.gc = True
    try:
        counter("gc")["collections"] += 1
        meddle("gc", random.Random(), nested_probe=False)
    finally:
        _busy.gc = False


def signaller(stop: threading.Event) -> None:
    rng = random.Random(args.seed)
    while not stop.wait(rng.random() * 2 * args.signal_every):
        signal.pthread_kill(MAIN, signal.SIGUSR1)


def main() -> None:
    failures: list[str] = []

    def run(index: int) -> None:
        try:
            body(index)
        except BaseException as exc:  # reported, never swallowed
            where = "".join(traceback.format_exception(exc)[-6:])
            failures.append(f"thread {index}: {type(exc).__name__}: {exc}\n{where}")

    probe_held, probe_end = threading.Event(), threading.Event()

    def prober() -> None:
        locks.acquire("probe")
        granted("locks", ["probe"], "mix")
        probe_held.set()
        probe_end.wait()
        locks.release("probe")

    probing = threading.Thread(target=prober, name="prober")
    probing.start()
    probe_held.wait()
    signal.signal(signal.SIGUSR1, on_signal)
    stop = threading.Event()
    sending = threading.Thread(target=signaller, args=(stop,), name="signaller")
    threads = [threading.Thread(target=run, args=(i,), name=f"mix{i}")
               for i in range(1, args.threads)]
    gc.callbacks.append(on_collection)
    gc.set_threshold(1)
    started = time.monotonic()
    try:
        sending.start()
        for thread in threads:
            thread.start()
        run(0)  # the main thread takes part (and takes every signal)
        for thread in threads:
            thread.join()
    finally:
        stop.set()
        gc.set_threshold(700, 10, 10)
        gc.callbacks.remove(on_collection)
    sending.join()
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    probe_end.set()
    elapsed = time.monotonic() - started
    probing.join()

    totals: collections.Counter[str] = collections.Counter()
    for tally in list(_counters):
        totals.update(tally)
    managers = {}
    for name, manager in MANAGERS.items():
        stats = manager.stats()
        managers[name] = {
            "len": len(manager), "held": stats.held, "waiting": stats.waiting,
            "acquisitions": [stats.acquisitions, totals[f"acq:{name}"]],
            "timeouts": [stats.timeouts, totals[f"timeouts:{name}"]],
            "deadlocks": [stats.deadlocks, totals[f"deadlocks:{name}"]],
            "contended_le_acquisitions": stats.contended <= stats.acquisitions,
            "waits_measured": [manager.metrics().wait_time.count, stats.contended],
        }
    lost = {
        f"{name}:{key!r}": [values[(name, key)], totals[f"inc:{name}:{key!r}"]]
        for (name, key) in values
        if values[(name, key)] != totals[f"inc:{name}:{key!r}"]
    }
    print(json.dumps({
        "failures": failures,
        "violations": violations[:20],
        "lost_updates": lost,
        "increments": sum(v for k, v in totals.items() if k.startswith("inc:")),
        "managers": managers,
        "faults": {key: totals[key] for key in (
            "signals", "collections", "meddle:took", "meddle:timeout", "meddle:nested",
            "probe:waited", "probe:nested", "meddle:observed")},
        "elapsed": round(elapsed, 2),
    }), flush=True)


if __name__ == "__main__":
    main()
