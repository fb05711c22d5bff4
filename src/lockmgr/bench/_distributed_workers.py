"""The worker processes of ``lockmgr-bench --scenario distributed`` (``_distributed``
drives them): each runs one implementation and answers the parent's commands over a pipe.

This module is what multiprocessing's fork server imports once for every worker it forks, so
it imports only what a worker needs (not the bench's command line). The peers are imported by
name when a worker makes its client: they are optional (``lockmgr[compare]``) and some have
no type hints.
"""

from __future__ import annotations

import importlib
import logging
import os
import time
import traceback
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

import psycopg
from psycopg import sql

from .. import LockLost, postgres

LEASE = 2.0  # seconds: the Redis locks' lease, as in the issue


@dataclass(frozen=True)
class Servers:
    """What every worker connects to, and this run's own names there."""

    pg_dsn: str
    redis_url: str
    run: str  # prefix of every key, lockmgr's namespace: this run's own
    storage: str  # the table of the data the paused-holder part protects


class Client(Protocol):
    """One implementation as a worker drives it: its locks by name."""

    def acquire(self, key: str, blocking: bool) -> bool: ...

    def release(self, key: str) -> bool:
        """False if the lock was no longer this holder's (a lease ran out, a session ended)."""
        ...

    def fence(self, key: str) -> int | None:
        """The fencing token of the current hold of ``key``, for a lock that gives one."""
        ...

    def lock_key(self, name: str) -> Hashable:
        """What the server locks for ``name`` (a Redis lock: the name itself, behind a
        prefix of the library's)."""
        ...


class LockmgrClient:
    def __init__(self, servers: Servers, fencing: bool = False) -> None:
        self.locks: postgres.PgLockManager[str] = postgres.PgLockManager(
            servers.pg_dsn, namespace=servers.run, fencing=fencing)
        self.fencing = fencing
        self.fences: dict[str, int] = {}

    def acquire(self, key: str, blocking: bool) -> bool:
        if not self.locks.acquire(key, blocking):
            return False
        if self.fencing:  # read as the hold begins, as ``lease.fence`` of ``hold()`` is
            self.fences[key] = self.locks.fence(key)
        return True

    def release(self, key: str) -> bool:
        try:
            self.locks.release(key)
        except LockLost:
            return False
        return True

    def fence(self, key: str) -> int | None:
        return self.fences.get(key)

    def lock_key(self, name: str) -> Hashable:
        return self.locks.advisory_key(name)


class RedisPyClient:
    def __init__(self, servers: Servers, sleep: float | None = None) -> None:
        redis = importlib.import_module("redis")
        self.client = redis.Redis.from_url(servers.redis_url)
        self.options = {"timeout": LEASE} if sleep is None else {"timeout": LEASE, "sleep": sleep}
        self.not_owned = redis.exceptions.LockNotOwnedError  # a release after the lease ran out
        self.locks: dict[str, Any] = {}

    def acquire(self, key: str, blocking: bool) -> bool:
        if key not in self.locks:
            self.locks[key] = self.client.lock(key, **self.options)
        return bool(self.locks[key].acquire(blocking=blocking))

    def release(self, key: str) -> bool:
        try:
            self.locks[key].release()
        except self.not_owned:
            return False
        return True

    def fence(self, key: str) -> int | None:
        return None  # its token is a random id, not an increasing number

    def lock_key(self, name: str) -> Hashable:
        return name


class PythonRedisLockClient:
    def __init__(self, servers: Servers) -> None:
        self.module = importlib.import_module("redis_lock")
        # A try that finds the key held logs a warning; here that is the expected answer.
        logging.getLogger("redis_lock.acquire").setLevel(logging.ERROR)
        self.client = importlib.import_module("redis").Redis.from_url(servers.redis_url)
        self.locks: dict[str, Any] = {}

    def acquire(self, key: str, blocking: bool) -> bool:
        if key not in self.locks:
            self.locks[key] = self.module.Lock(self.client, key, expire=int(LEASE))
        return bool(self.locks[key].acquire(blocking=blocking))

    def release(self, key: str) -> bool:
        try:
            self.locks[key].release()
        except self.module.NotAcquired:
            return False
        return True

    def fence(self, key: str) -> int | None:
        return None  # its id is random, not an increasing number

    def lock_key(self, name: str) -> Hashable:
        return name


class PotteryClient:
    def __init__(self, servers: Servers) -> None:
        self.module = importlib.import_module("pottery")
        self.client = importlib.import_module("redis").Redis.from_url(servers.redis_url)
        self.locks: dict[str, Any] = {}

    def acquire(self, key: str, blocking: bool) -> bool:
        if key not in self.locks:
            self.locks[key] = self.module.Redlock(key=key, masters={self.client},
                                                  auto_release_time=LEASE)
        return bool(self.locks[key].acquire(blocking=blocking))

    def release(self, key: str) -> bool:
        try:
            self.locks[key].release()
        except self.module.ReleaseUnlockedLock:
            return False
        return True

    def fence(self, key: str) -> int | None:
        return None  # no token beyond a random id

    def lock_key(self, name: str) -> Hashable:
        return name


class ToozClient:
    def __init__(self, servers: Servers) -> None:
        coordination = importlib.import_module("tooz.coordination")
        with warnings.catch_warnings():
            # tooz has declared its PostgreSQL driver deprecated (the README says so).
            warnings.simplefilter("ignore", DeprecationWarning)
            self.coordinator = coordination.get_coordinator(
                servers.pg_dsn, f"lockmgr-bench-{os.getpid()}".encode())
        self.coordinator.start()
        self.locks: dict[str, Any] = {}

    def acquire(self, key: str, blocking: bool) -> bool:
        if key not in self.locks:
            self.locks[key] = self.coordinator.get_lock(key.encode())
        return bool(self.locks[key].acquire(blocking=blocking))

    def release(self, key: str) -> bool:
        return bool(self.locks[key].release())  # False: it was not holding

    def fence(self, key: str) -> int | None:
        return None

    def lock_key(self, name: str) -> Hashable:
        # tooz's own mapping, read from the lock it makes: 2 bytes of the name's MD5, locked
        # as pg_advisory_lock(byte 0, byte 1).
        key: bytes = self.coordinator.get_lock(name.encode()).key
        return key


CLIENTS: dict[str, Callable[[Servers], Client]] = {
    "lockmgr": LockmgrClient,
    "lockmgr fenced": lambda servers: LockmgrClient(servers, fencing=True),
    "redis-py": RedisPyClient,
    "redis-py 1ms": lambda servers: RedisPyClient(servers, sleep=0.001),
    "python-redis-lock": PythonRedisLockClient,
    "pottery": PotteryClient,
    "tooz": ToozClient,
}


class Storage:
    """The data the locks protect, a row per key in PostgreSQL. A holder with a fence writes
    only over an older fence (``fence < %s``): a write with a stale fence changes nothing."""

    def __init__(self, servers: Servers) -> None:
        self.conn = psycopg.connect(servers.pg_dsn, autocommit=True)
        self.table = sql.Identifier(servers.storage)

    def write(self, key: str, value: str, fence: int | None) -> bool:
        if fence is None:
            done = self.conn.execute(
                sql.SQL("UPDATE {} SET value = %s WHERE id = %s").format(self.table),
                (value, key))
        else:
            done = self.conn.execute(
                sql.SQL("UPDATE {} SET value = %s, fence = %s WHERE id = %s AND fence < %s")
                .format(self.table), (value, fence, key, fence))
        return done.rowcount == 1


class WorkerSide:
    """What a worker process does with each command of the parent's."""

    def __init__(self, client: Client, storage: Storage, pipe: Connection) -> None:
        self.client = client
        self.storage = storage
        self.pipe = pipe

    def pairs(self, key: str, seconds: float) -> int:
        deadline, done = time.monotonic() + seconds, 0
        while time.monotonic() < deadline:
            self.client.acquire(key, True)
            self.client.release(key)
            done += 1
        return done

    def acquire(self, key: str) -> float:
        self.client.acquire(key, True)
        return time.monotonic()

    def try_acquire(self, key: str) -> bool:
        return self.client.acquire(key, False)

    def contend(self, key: str) -> float:
        """Answers twice: once its try has failed (the key is held: from now on this process
        is waiting for it), then once it holds the key."""
        if self.client.acquire(key, False):
            self.client.release(key)
            raise RuntimeError(f"{key!r} was free: nothing held it")
        self.pipe.send(("ok", time.monotonic()))
        self.client.acquire(key, True)
        return time.monotonic()

    def release(self, key: str, after: float) -> tuple[float, bool]:
        """Keeps ``key`` ``after`` more seconds (the rest of the critical section), then
        releases it: when the release began, and whether the lock was still this holder's."""
        time.sleep(after)
        began = time.monotonic()
        return began, self.client.release(key)

    def write(self, key: str, value: str) -> tuple[bool, float]:
        accepted = self.storage.write(key, value, self.client.fence(key))
        return accepted, time.monotonic()

    def distinct_lock_keys(self, prefix: str, count: int) -> int:
        return len({self.client.lock_key(f"{prefix}{n}") for n in range(count)})

    def colliding_names(self, prefix: str, count: int) -> tuple[str, str]:
        """Two of ``count`` names that this implementation locks as one key (a birthday
        search: tooz's 65,536 keys collide within a few hundred names)."""
        seen: dict[Hashable, str] = {}
        for n in range(count):
            name = f"{prefix}{n}"
            earlier = seen.setdefault(self.client.lock_key(name), name)
            if earlier != name:
                return earlier, name
        raise RuntimeError(f"no two of {count:,} names share a lock key")


def serve(contender: str, servers: Servers, pipe: Connection) -> None:
    """A worker process: connects, takes and gives back a key of its own (so that every
    connection is open and every script loaded before the parent's clock starts), then
    answers commands until the parent closes the pipe."""
    client = CLIENTS[contender](servers)
    storage = Storage(servers)
    warm_up = f"{servers.run}:warm-up:{os.getpid()}"
    client.acquire(warm_up, True)
    client.release(warm_up)
    side = WorkerSide(client, storage, pipe)
    pipe.send(("ok", "ready"))
    while True:
        try:
            command, *args = pipe.recv()
        except EOFError:  # the parent is done (or gone)
            return
        try:
            pipe.send(("ok", getattr(side, command)(*args)))
        except Exception:
            pipe.send(("error", traceback.format_exc()))
