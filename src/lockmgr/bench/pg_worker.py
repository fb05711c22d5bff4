"""A worker process of ``postgres_processes`` (``_servers``): run as
``python -m lockmgr.bench.pg_worker DSN NAMESPACE SCENARIO KEYS INDEX SECONDS``, it connects,
waits for a line on stdin (the start), holds keys for SECONDS and prints how many holds it
made."""

from __future__ import annotations

import itertools
import random
import sys
import time

from lockmgr.postgres import PgLockManager


def main() -> None:
    dsn, namespace, scenario, keys, index = sys.argv[1:6]
    locks: PgLockManager[str] = PgLockManager(dsn, namespace=namespace)
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


if __name__ == "__main__":
    main()
