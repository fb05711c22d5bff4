"""Instructions per uncontended ``acquire`` + ``release`` of the compiled core, by callgrind:
the same loop run for N and 2N iterations, the difference divided by N (what the
interpreter does to start and stop cancels out). Deterministic, so a few instructions of
difference between two builds show, where wall-clock timings on a shared machine would not.

    python3 scripts/pair-instructions.py                      # LockManager()
    python3 scripts/pair-instructions.py --log-waits-after 1  # the slow-wait log on
    python3 scripts/pair-instructions.py --src OTHER/src      # another checkout's build
    python3 scripts/pair-instructions.py --loop aio-block     # async with aio[k] (a task)
    python3 scripts/pair-instructions.py --loop asyncio-lock-block  # the same, asyncio.Lock
    python3 scripts/pair-instructions.py --semaphore-limit 1  # SemaphoreManager(1) instead
    python3 scripts/pair-instructions.py --loop host --iterations 5000  # HostLockManager

``--loop``: ``sync`` (the default), ``aio-block`` / ``aio-pair`` (``async with aio[k]`` /
``await aio.acquire(k)`` + ``aio.release(k)`` in one task), and ``asyncio-lock-block`` /
``asyncio-lock-pair``, the same on one ``asyncio.Lock``, to compare with; ``host``:
``lockmgr.host.HostLockManager``'s pair on the main thread, in a temporary directory (the
system calls' kernel side not counted).

Through a PostgreSQL server, ``--pg-dsn DSN --loop postgres`` (``PgLockManager``, the
server-pairs worker's pair) and ``--loop libpq`` (the bare libpq loop it is compared with):
the client's own work per pair, which the machine's load does not move as it moves the
benchmark's CPU times (the server's, and the system calls' kernel side, are not counted).

    python3 scripts/pair-instructions.py --pg-dsn postgresql://postgres@127.0.0.1/postgres --loop postgres

Needs valgrind; the core must be built (``pip install -e .`` or ``build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

LOOP = """
import sys
if sys.argv[1]:
    sys.path.insert(0, sys.argv[1])
if sys.argv[4] in ("postgres", "libpq"):  # the server-pairs worker's pair, its keys warm
    from lockmgr.bench.server_worker import pair_calls
    keys = [f"k{n}" for n in range(16)]
    acquire, release = pair_calls(sys.argv[4], sys.argv[5], "pair-instructions", keys)
    for _ in range(2):
        for key in keys:
            acquire(key); release(key)
    for _ in range(int(sys.argv[3]) // len(keys)):
        for key in keys:
            acquire(key); release(key)
    sys.exit()
if sys.argv[4] == "host":  # HostLockManager's pair on the main thread (handlers held off)
    import shutil, tempfile
    from lockmgr.host import HostLockManager
    directory = tempfile.mkdtemp()
    with HostLockManager(directory) as locks:
        for _ in range(int(sys.argv[3])):
            locks.acquire("k"); locks.release("k")
    shutil.rmtree(directory)
    sys.exit()
from lockmgr._core import LockManager, SemaphoreManager
after = float(sys.argv[2])
options = {"log_waits_after": after} if after >= 0 else {}
limit = int(sys.argv[6])  # 0: a LockManager; else a SemaphoreManager with that limit
locks = SemaphoreManager(limit, **options) if limit else LockManager(**options)

def run(iterations, acquire=locks.acquire, release=locks.release):
    for _ in range(iterations):
        acquire("k"); release("k")

loop = sys.argv[4]
if loop == "sync":
    run(int(sys.argv[3]))
else:
    import asyncio

    aio, lock = locks.aio, asyncio.Lock()

    async def aio_block(n, m=aio):
        for _ in range(n):
            async with m["k"]:
                pass

    async def aio_pair(n, a=aio.acquire, r=aio.release):
        for _ in range(n):
            await a("k"); r("k")

    async def lock_block(n, l=lock):
        for _ in range(n):
            async with l:
                pass

    async def lock_pair(n, a=lock.acquire, r=lock.release):
        for _ in range(n):
            await a(); r()

    loops = {"aio-block": aio_block, "aio-pair": aio_pair,
             "asyncio-lock-block": lock_block, "asyncio-lock-pair": lock_pair}
    asyncio.run(loops[loop](int(sys.argv[3])))
if after >= 0:
    locks.metrics()
"""
LOOPS = ["sync", "aio-block", "aio-pair", "asyncio-lock-block", "asyncio-lock-pair", "host"]
PG_LOOPS = ["postgres", "libpq"]  # (through --pg-dsn's server)


def instructions(src: str, after: float, iterations: int, loop: str = "sync",
                 dsn: str = "", limit: int = 0) -> int:
    with tempfile.TemporaryDirectory() as work:
        script = Path(work) / "loop.py"
        script.write_text(LOOP)
        done = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={work}/out",
             sys.executable, str(script), src, str(after), str(iterations), loop, dsn,
             str(limit)],
            capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": "0"})  # the same dict probes every run
    return int(re.search(r"Collected : (\d+)", done.stderr).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default="", help="a checkout's src/ to import lockmgr from")
    parser.add_argument("--log-waits-after", type=float, default=-1.0)
    parser.add_argument("--iterations", type=int,
                        help="pairs of the loop (default 100,000; through a server, 800)")
    parser.add_argument("--loop", choices=LOOPS + PG_LOOPS, default="sync")
    parser.add_argument("--pg-dsn", default="", help="the server of the postgres and libpq loops")
    parser.add_argument("--semaphore-limit", type=int, default=0,
                        help="a SemaphoreManager with this limit instead of a LockManager")
    args = parser.parse_args()
    if (args.loop in PG_LOOPS) != bool(args.pg_dsn):
        parser.error("--pg-dsn goes with --loop postgres or libpq, and they with it")
    iterations = args.iterations or (800 if args.loop in PG_LOOPS else 100_000)
    once = instructions(args.src, args.log_waits_after, iterations, args.loop, args.pg_dsn,
                        args.semaphore_limit)
    twice = instructions(args.src, args.log_waits_after, 2 * iterations, args.loop,
                         args.pg_dsn, args.semaphore_limit)
    what = "block" if args.loop.endswith("block") else "acquire + release"
    print(f"{(twice - once) / iterations:.1f} instructions per {what} "
          f"({args.loop}, the loop included)")


if __name__ == "__main__":
    main()
