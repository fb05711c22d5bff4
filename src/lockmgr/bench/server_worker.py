"""A worker process of ``server-pairs`` (``_servers``): run as
``python -m lockmgr.bench.server_worker BACKEND ADDRESS NAMESPACE INDEX SECONDS`` (BACKEND
``postgres`` or ``redis-py``), it warms up on its own keys, prints ``ready``, waits for a
line on stdin (the start), makes acquire+release pairs for SECONDS and prints how many."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    backend, address, namespace, index, seconds = sys.argv[1:6]
    keys = [f"{namespace}:{index}:{n}" for n in range(16)]  # this process's own keys
    acquire: Callable[[str], Any]
    release: Callable[[str], Any]
    if backend == "postgres":
        from lockmgr.postgres import PgLockManager
        locks: PgLockManager[str] = PgLockManager(address, namespace=namespace)
        acquire, release = locks.acquire, locks.release
    else:
        import redis
        client = redis.Redis.from_url(address)
        handles = {key: client.lock(key) for key in keys}  # redis-py's Lock: SET NX, Lua release
        acquire = lambda key: handles[key].acquire()  # noqa: E731
        release = lambda key: handles[key].release()  # noqa: E731
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


if __name__ == "__main__":
    main()
