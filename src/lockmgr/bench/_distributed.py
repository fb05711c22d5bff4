"""``lockmgr-bench --scenario distributed``: ``PgLockManager`` beside the Redis locks and tooz.

Every implementation runs in worker processes of its own, as applications run them, each
driven by the parent over a pipe, one command at a time and each answered, every wait bounded.
The workers come from multiprocessing's fork server: a clean process that imported lockmgr and
the peers once, so that a worker starts in milliseconds rather than a second of interpreter
start and imports, and holds nothing of the parent's (a child forked from the parent would
start with the parent's connections). Times are
``time.monotonic()``: one clock for every process of the machine, so a release in one process
and an acquisition in another compare directly.

The peers (``lockmgr[compare]``), each used as its documentation shows, with the 2-second
lease of the issue where it has one:

- redis-py's ``Lock`` (``client.lock(name, timeout=2)``: SET NX with a lease, polling every
  ``sleep`` seconds, 0.1 by default; the ``redis-py 1ms`` column polls every millisecond);
- python-redis-lock (``Lock(client, name, expire=2)``: SET NX with a lease; a waiter blocks
  on a list that the release pushes to);
- pottery's ``Redlock`` with one master (``auto_release_time=2``: SET NX with a lease, retried
  after a random delay of up to 0.2 s);
- tooz's PostgreSQL driver (session advisory locks on a connection opened per acquisition,
  the name mapped to 2 bytes of its MD5).

The parts, per implementation: acquire+release pairs per second (each process on a key of its
own, then all on one key); the hand-off latency from a release to the next process holding the
key; how long a SIGKILLed holder keeps its key; a holder SIGSTOPped for longer than the lease,
then resumed to write and release (does a second holder get in meanwhile, is the first one's
stale write accepted, does its release fail); and whether two names that tooz maps to one
advisory key exclude each other, with the number of distinct advisory keys among many names.

The writes go to a table in PostgreSQL, a row per key. The Redis locks give no fencing token
(their tokens are random ids), so their holders write unfenced, as does plain lockmgr. The
``lockmgr fenced`` column is ``PgLockManager(dsn, fencing=True)``: its holders write only over
an older fence, and its paused holder also has its server session ended during the pause (as
a failover would), so that a second holder does get in and the fence is what keeps the
first one's late write out.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from .. import postgres
from ..postgres._sql import _GRANTED_ADVISORY
from ._distributed_workers import LEASE, Servers, serve
from ._measure import Results, Settings, percentile, progress

PAUSE = LEASE * 1.25  # how long the paused holder stays stopped: past its lease
MOST_PAUSES = 3  # paused holders per implementation in a full run (one with --quick)
HOLD_SPREAD = 0.2  # a hand-off's holder keeps the key uniformly 0-0.2 s after the waiter
#                    is waiting: every phase of a 0.1 s polling loop (pottery's 0-0.2 s) is met
PATIENCE = 30.0  # bound on any one answer from a worker, generous for a busy 2-core machine
STARTUP = 120.0  # bound on a worker's start: the interpreter, the imports, the connections
NAMES = 100_000  # names counted for their distinct lock keys; bound of the colliding-pair search
#: Whose paused holder also loses its server session during the pause: with ``fencing=True``
#: a second holder then gets in, and the fence is what keeps the first one's write out.
SESSION_ENDED_WHILE_PAUSED = frozenset({"lockmgr fenced"})
#: What the fork server imports once for every worker it forks: the workers' module (not this
#: one, which imports the bench's measuring: a worker started by ``python -m lockmgr.bench``
#: runs the command line afresh as its ``__mp_main__``) and the peers.
PRELOADED = ["lockmgr.bench._distributed_workers", "redis", "redis_lock", "pottery",
             "tooz.coordination", "tooz.drivers.pgsql"]

#: The columns, and the parts each runs beside the pairs and hand-offs that all run:
#: "lockmgr fenced" (``fencing=True``) shows what its fences cost, and a paused holder whose
#: session the server ended meanwhile; "redis-py 1ms" how far faster polling goes.
EVERY_PART = frozenset({"keys", "paused", "killed"})
CONTENDERS: dict[str, frozenset[str]] = {
    "lockmgr": EVERY_PART,
    "lockmgr fenced": frozenset({"paused"}),
    "redis-py": EVERY_PART,
    "redis-py 1ms": frozenset(),
    "python-redis-lock": EVERY_PART,
    "pottery": EVERY_PART,
    "tooz": EVERY_PART,
}
Row = tuple[str, float, str]  # metric, value, unit


# -- the parent's side of the workers ------------------------------------------------------


class Worker:
    """One worker process of one implementation, and the parent's end of its pipe."""

    def __init__(self, contender: str, servers: Servers) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOADED)  # used when the fork server first starts
        self.contender = contender
        self.pipe, child_end = context.Pipe()
        self.process = context.Process(target=serve, args=(contender, servers, child_end),
                                       name=f"lockmgr-bench {contender}", daemon=True)
        self.process.start()
        child_end.close()
        assert self.process.pid is not None  # started
        self.pid: int = self.process.pid

    def send(self, command: str, *args: Any) -> None:
        self.pipe.send((command, *args))

    def answered_within(self, seconds: float) -> bool:
        return self.pipe.poll(max(0.0, seconds))

    def receive(self, limit: float = PATIENCE) -> Any:
        if not self.answered_within(limit):
            raise RuntimeError(f"a {self.contender} worker did not answer within {limit:g} s")
        try:
            status, value = self.pipe.recv()
        except EOFError:
            raise RuntimeError(f"a {self.contender} worker ended (exit code "
                               f"{self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"a {self.contender} worker failed:\n{value}")
        return value

    def call(self, command: str, *args: Any, limit: float = PATIENCE) -> Any:
        self.send(command, *args)
        return self.receive(limit)

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        self.process.kill()  # SIGKILL, which also ends a stopped process
        self.process.join()
        self.pipe.close()


@contextlib.contextmanager
def started(contender: str, servers: Servers, count: int) -> Iterator[list[Worker]]:
    """``count`` workers of ``contender``, each connected and warm; killed afterwards."""
    workers: list[Worker] = []
    try:
        for _ in range(count):
            workers.append(Worker(contender, servers))
        for worker in workers:
            worker.receive(STARTUP)
        yield workers
    finally:
        for worker in workers:
            worker.kill()


def pairs_per_second(workers: list[Worker], keys: list[str], seconds: float) -> float:
    """Each worker takes and gives back its key of ``keys`` for ``seconds``, all at once."""
    for worker, key in zip(workers, keys):
        worker.send("pairs", key, seconds)
    done: int = sum(worker.receive(seconds + PATIENCE) for worker in workers)
    return done / seconds


def hand_off_latencies(first: Worker, second: Worker, key: str, samples: int,
                       rng: random.Random) -> list[float]:
    """Seconds from the start of a release to the waiting process holding the key; the two
    processes take turns as holder and waiter."""
    first.call("acquire", key)
    holder, waiter, latencies = first, second, []
    for _ in range(samples):
        waiter.send("contend", key)
        waiter.receive()  # its try failed: it is waiting for the key
        released_at, _ = holder.call("release", key, rng.uniform(0, HOLD_SPREAD))
        latencies.append(waiter.receive() - released_at)
        holder, waiter = waiter, holder
    holder.call("release", key, 0.0)
    return latencies


def killed_holder_recovery(holder: Worker, waiter: Worker, key: str) -> float:
    """Seconds from SIGKILL of the key's holder to the waiting process holding it."""
    holder.call("acquire", key)
    waiter.send("contend", key)
    waiter.receive()
    killed_at = time.monotonic()
    holder.kill()
    recovered = waiter.receive(LEASE + PATIENCE) - killed_at
    waiter.call("release", key, 0.0)
    return float(recovered)


@dataclass
class PausedHolder:
    """What happened around a holder stopped for ``PAUSE`` seconds."""

    second_got_in: bool  # a second process held the key before the first one's release
    overlap: float  # both believed they held it: second's acquire to first's release
    stale_write_accepted: bool  # the first one wrote after losing its lock, and it was taken
    release_failed: bool  # the first's release found its lock gone


def paused_holder(first: Worker, second: Worker, key: str,
                  end_session: Callable[[], None] | None = None) -> PausedHolder:
    """``first`` holds ``key``, ``second`` waits for it; ``first`` is stopped (SIGSTOP) for
    ``PAUSE`` seconds, as a long GC pause, a swapped-out or migrated VM would stop it, then
    resumed (SIGCONT): it writes, still believing it holds the key, and releases.
    ``end_session`` (lockmgr) ends its server session just after it was stopped."""
    first.call("acquire", key)
    second.send("contend", key)
    second.receive()
    first.pause()
    paused_at = time.monotonic()
    second_held_at = None
    try:
        if end_session is not None:
            end_session()
        if second.answered_within(paused_at + PAUSE - time.monotonic()):
            second_held_at = second.receive()
            second.call("write", key, "second")
        time.sleep(max(0.0, paused_at + PAUSE - time.monotonic()))  # the pause runs its length
    finally:
        first.resume()
    first_write_accepted, _ = first.call("write", key, "first")
    first_released_at, first_still_held = first.call("release", key, 0.0)
    if second_held_at is None:
        second_held_at = second.receive()
        second.call("write", key, "second")
    second.call("release", key, 0.0)
    # ``release`` answers when the first one's release began, ``contend`` once the second
    # one held the key: a second holder before that held it at the same time as the first
    # (however soon after the pause its poll found the lease gone). No correct lock shows it.
    overlap = max(0.0, first_released_at - second_held_at)
    return PausedHolder(
        second_got_in=overlap > 0,
        overlap=overlap,
        # Its lock was gone by the time it wrote (its lease ran out, or its session ended),
        # whether the second holder had written yet or not: only a fence keeps it out.
        stale_write_accepted=bool(first_write_accepted and not first_still_held),
        release_failed=not first_still_held)


def end_session_holding(servers: Servers, key: str) -> None:
    """End the server session holding lockmgr's ``key``, as an administrator, a failover or
    a network partition (the server's keepalive giving up on the paused host) would."""
    with psycopg.connect(servers.pg_dsn, autocommit=True) as admin:
        ended = admin.execute(
            f"SELECT pg_terminate_backend(pid) FROM {_GRANTED_ADVISORY} %s",
            (postgres.advisory_key(key, servers.run),)).fetchall()
    if not ended:
        raise RuntimeError(f"no server session holds {key!r}")


@dataclass
class Run:
    """One run of the scenario: where, how long, where its rows go, and its keys' names."""

    servers: Servers
    settings: Settings
    results: Results

    def key(self, contender: str, part: str, n: int = 0) -> str:
        return f"{self.servers.run}:{contender}:{part}:{n}"

    def add(self, contender: str, metric: str, value: float, unit: str) -> None:
        self.results.add("distributed", contender, metric, value, unit)


def measure_throughput_and_hand_off(run: Run, contender: str, workers: list[Worker]) -> None:
    seconds = run.settings.scaled(0.5, 2.0)
    count = len(workers)
    progress(f"distributed: {contender}, pairs/s")
    own = [run.key(contender, "own", n) for n in range(count)]
    run.add(contender, f"pairs, {count} processes with a key each",
            pairs_per_second(workers, own, seconds), "pairs/s")
    hot = [run.key(contender, "hot")] * count
    run.add(contender, f"pairs, {count} processes on 1 key",
            pairs_per_second(workers, hot, seconds), "pairs/s")
    progress(f"distributed: {contender}, hand-off")
    samples = int(run.settings.scaled(10, 200))
    latencies = hand_off_latencies(workers[0], workers[1], run.key(contender, "hand-off"),
                                   samples, random.Random(contender))
    run.add(contender, "hand-off p50", 1000 * statistics.median(latencies), "ms")
    run.add(contender, "hand-off p99", 1000 * percentile(latencies, 0.99), "ms")


def measure_distinct_keys(run: Run, contender: str, workers: list[Worker],
                          colliding: tuple[str, str]) -> None:
    """Whether two names tooz locks as one exclude each other here, and how many distinct
    lock keys ``NAMES`` names get."""
    first, second = workers[0], workers[1]
    if not first.call("try_acquire", colliding[0]):
        raise RuntimeError(f"{contender}: {colliding[0]!r} was not free")
    excluded = not second.call("try_acquire", colliding[1])
    if not excluded:
        second.call("release", colliding[1], 0.0)
    first.call("release", colliding[0], 0.0)
    run.add(contender, "a tooz-colliding pair excluded each other", float(excluded), "yes=1")
    distinct = first.call("distinct_lock_keys", f"{run.servers.run}:name:", NAMES)
    run.add(contender, f"lock keys of {NAMES:,} names", distinct, "keys")


def paused_rows(run: Run, contender: str, workers: list[Worker]) -> list[Row]:
    keys = [run.key(contender, "paused", n)
            for n in range(int(run.settings.scaled(1, MOST_PAUSES)))]
    ends_session = contender in SESSION_ENDED_WHILE_PAUSED
    pauses = [paused_holder(workers[0], workers[1], key,
                            functools.partial(end_session_holding, run.servers, key)
                            if ends_session else None)
              for key in keys]
    return [
        ("paused holder: a 2nd holder got in",
         statistics.median(pause.second_got_in for pause in pauses), "yes=1"),
        ("paused holder: overlap", statistics.median(pause.overlap for pause in pauses), "s"),
        ("paused holder: its stale write accepted",
         statistics.median(pause.stale_write_accepted for pause in pauses), "yes=1"),
        ("paused holder: its release failed",
         statistics.median(pause.release_failed for pause in pauses), "yes=1"),
    ]


def killed_rows(run: Run, contender: str, workers: list[Worker]) -> list[Row]:
    recoveries = [killed_holder_recovery(workers[0], workers[1], run.key(contender, "killed"))]
    for n in range(1, int(run.settings.scaled(1, 5))):  # each further sample: a new victim
        with started(contender, run.servers, 1) as (holder,):
            recoveries.append(killed_holder_recovery(holder, workers[1],
                                                     run.key(contender, "killed", n)))
    return [("killed holder: key free after", 1000 * statistics.median(recoveries), "ms")]


def failure_rows(run: Run, contender: str, workers: list[Worker]) -> list[Row]:
    """The paused and the killed holder (bound by the leases: seconds each with a Redis
    lock), returned rather than added: these run for all implementations at once."""
    parts = CONTENDERS[contender]
    return ((paused_rows(run, contender, workers) if "paused" in parts else [])
            + (killed_rows(run, contender, workers) if "killed" in parts else []))


def create_storage(servers: Servers, keys: list[str]) -> None:
    with psycopg.connect(servers.pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id text PRIMARY KEY, value text NOT NULL, "
                             "fence bigint NOT NULL DEFAULT 0)")
                     .format(sql.Identifier(servers.storage)))
        with conn.cursor() as cursor:
            cursor.executemany(sql.SQL("INSERT INTO {} (id, value) VALUES (%s, '')")
                               .format(sql.Identifier(servers.storage)), [(key,) for key in keys])


def drop_storage(servers: Servers) -> None:
    with psycopg.connect(servers.pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(servers.storage)))


def distributed(pg_dsn: str, redis_url: str, settings: Settings, results: Results) -> None:
    """The whole scenario: the timed parts one implementation after the other, then the
    lease-bound failure parts of all implementations at once."""
    stamp = f"{os.getpid()}_{time.time_ns()}"
    servers = Servers(pg_dsn, redis_url, run=f"lockmgr-bench-{stamp}",
                      storage=f"lockmgr_bench_storage_{stamp}")
    run = Run(servers, settings, results)
    count = max(2, settings.threads)
    create_storage(servers, [run.key(contender, "paused", n) for contender in CONTENDERS
                             for n in range(MOST_PAUSES)])
    try:
        with contextlib.ExitStack() as stack:
            progress(f"distributed: starting {count} worker processes per implementation")
            pools = {contender: stack.enter_context(started(contender, servers, count))
                     for contender in CONTENDERS}
            for contender, workers in pools.items():
                measure_throughput_and_hand_off(run, contender, workers)
            colliding = pools["tooz"][0].call("colliding_names", f"{servers.run}:pair:", NAMES)
            for contender, workers in pools.items():
                if "keys" in CONTENDERS[contender]:
                    measure_distinct_keys(run, contender, workers, colliding)
            failing = {contender: workers for contender, workers in pools.items()
                       if CONTENDERS[contender] & {"paused", "killed"}}
            progress(f"distributed: paused and killed holders ({', '.join(failing)} at once)")
            with ThreadPoolExecutor(max_workers=len(failing)) as executor:
                futures = {contender: executor.submit(failure_rows, run, contender, workers)
                           for contender, workers in failing.items()}
                for contender, future in futures.items():
                    for metric, value, unit in future.result():
                        run.add(contender, metric, value, unit)
    finally:
        drop_storage(servers)
