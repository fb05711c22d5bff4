"""A worker process of ``server-pairs`` (``_servers``): run as
``python -m lockmgr.bench.server_worker BACKEND ADDRESS NAMESPACE INDEX SECONDS``, it warms up
on its own keys, prints ``ready``, waits for a line on stdin (the start), makes
acquire+release pairs for SECONDS and prints how many, and the CPU seconds the process used
meanwhile.

BACKEND: ``postgres`` (lockmgr's ``PgLockManager``), ``psycopg`` (the same advisory locks in
a bare loop of prepared statements through a psycopg cursor), ``libpq`` (the same two
prepared statements through ``psycopg.pq``, no cursor: the floor of a pair from Python) or
``redis-py`` (its ``Lock``)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

_LOCK = "SELECT pg_catalog.pg_advisory_lock($1::pg_catalog.int8)"
_UNLOCK = "SELECT pg_catalog.pg_advisory_unlock($1::pg_catalog.int8)"


def pair_calls(backend: str, address: str, namespace: str,
               keys: list[str]) -> tuple[Callable[[str], Any], Callable[[str], Any]]:
    """The acquire and the release of one key through ``backend``."""
    if backend == "postgres":
        from lockmgr.postgres import PgLockManager
        locks: PgLockManager[str] = PgLockManager(address, namespace=namespace)
        return locks.acquire, locks.release
    if backend in ("psycopg", "libpq"):
        import psycopg

        from lockmgr.postgres import advisory_key
        conn = psycopg.connect(address, autocommit=True)
        idents = {key: advisory_key(key, namespace) for key in keys}  # lockmgr's keys, hashed once
        if backend == "psycopg":
            cursor = conn.cursor()
            lock, unlock = (sql.replace("$1", "%s") for sql in (_LOCK, _UNLOCK))
            return (lambda key: cursor.execute(lock, (idents[key],), prepare=True),
                    lambda key: cursor.execute(unlock, (idents[key],), prepare=True))
        pgconn = conn.pgconn
        for name, sql in ((b"lock", _LOCK), (b"unlock", _UNLOCK)):
            _checked(pgconn.prepare(name, sql.encode()))
        params = {key: [b"%d" % ident] for key, ident in idents.items()}
        exec_prepared = pgconn.exec_prepared
        return (lambda key: _checked(exec_prepared(b"lock", params[key])),
                lambda key: _checked(exec_prepared(b"unlock", params[key])))
    import redis
    client = redis.Redis.from_url(address)
    handles = {key: client.lock(key) for key in keys}  # redis-py's Lock: SET NX, Lua release
    return (lambda key: handles[key].acquire(), lambda key: handles[key].release())


_SUCCEEDED = frozenset({1, 2})  # libpq's PGRES_COMMAND_OK and PGRES_TUPLES_OK (pq.ExecStatus)


def _checked(result: Any) -> Any:
    """A libpq result, unless it failed (a loop that fails fast would measure nothing)."""
    if result.status not in _SUCCEEDED:
        raise RuntimeError(result.error_message.decode(errors="replace"))
    return result


def main() -> None:
    backend, address, namespace, index, seconds = sys.argv[1:6]
    keys = [f"{namespace}:{index}:{n}" for n in range(16)]  # this process's own keys
    acquire, release = pair_calls(backend, address, namespace, keys)
    for key in keys:  # connected, statements prepared, scripts loaded: the clock starts warm
        acquire(key)
        release(key)
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.process_time()
    deadline, done = time.monotonic() + float(seconds), 0
    while time.monotonic() < deadline:
        for key in keys:
            acquire(key)
            release(key)
        done += len(keys)
    print(done, time.process_time() - started, flush=True)


if __name__ == "__main__":
    main()
