"""A worker process of the ``host`` scenario (``_host``): run as
``python -m lockmgr.bench.host_worker BACKEND DIRECTORY DSN NAMESPACE``, it prints ``ready``,
then answers each JSON command read from stdin with one JSON line on stdout.

BACKEND: ``lockmgr.host`` (``HostLockManager`` on DIRECTORY; the engine is the one the
process imports: ``LOCKMGR_NO_EXTENSIONS=1`` for the pure twin), ``lockmgr`` (the
in-process ``LockManager``), ``postgres`` (``PgLockManager`` on DSN), ``filelock``,
``portalocker`` and ``fasteners`` (a file per key in DIRECTORY, each as its documentation
shows it: blocking waits poll at the library's default interval).

Times across processes are read from ``CLOCK_MONOTONIC``, one clock for the whole host.
"""

from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any


def now_ns() -> int:
    """The host-wide monotonic clock: stamps of two processes compare."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class Backend:
    """One key's acquire and release through one library (its lock objects made once per
    key and kept, as an application would)."""

    def __init__(self, name: str, directory: str, dsn: str, namespace: str) -> None:
        self.name = name
        self.directory = directory
        self.acquire: Callable[[str], Any]
        self.release: Callable[[str], Any]
        if name == "lockmgr.host":
            from lockmgr.host import HostLockManager
            host: HostLockManager[str] = HostLockManager(directory, namespace=namespace)
            self.acquire, self.release = host.acquire, host.release
        elif name == "lockmgr":
            from lockmgr import LockManager
            local: LockManager[str] = LockManager()
            self.acquire, self.release = local.acquire, local.release
        elif name == "postgres":
            from lockmgr.postgres import PgLockManager
            remote: PgLockManager[str] = PgLockManager(dsn, namespace=namespace)
            self.acquire, self.release = remote.acquire, remote.release
        else:
            files: dict[str, Any] = {}
            make = self._file_lock(name)

            def lock_of(key: str) -> Any:
                lock = files.get(key)
                if lock is None:
                    lock = files[key] = make(os.path.join(directory, f"{namespace}-{key}.lock"))
                return lock

            self.acquire = lambda key: lock_of(key).acquire()
            self.release = lambda key: lock_of(key).release()

    @staticmethod
    def _file_lock(name: str) -> Callable[[str], Any]:
        """``path -> lock`` of a file-lock library ([bench] extra: imported by name, so that
        lockmgr's typing does not depend on theirs)."""
        module = importlib.import_module(name)
        if name == "filelock":
            make: Callable[[str], Any] = module.FileLock  # waits poll every 0.05 s
            return make
        if name == "portalocker":
            # Its default timeout is 5 s; a waiter here must outwait any holder. Polls every
            # 0.25 s (its default check_interval).
            return lambda path: module.Lock(path, timeout=3600)
        if name == "fasteners":
            make = module.InterProcessLock  # waits back off from 0.01 s to 0.1 s
            return make
        raise ValueError(f"unknown backend {name!r}")


def pairs(backend: Backend, seconds: float, held: int) -> dict[str, Any]:
    """The cost of one acquire+release pair (µs, the best of 5 runs of about ``seconds``
    each) on a key of its own, first with nothing else held, then with ``held`` other keys
    held."""
    timer = timeit.Timer("acquire(key); release(key)",
                         globals={"acquire": backend.acquire, "release": backend.release,
                                  "key": "pair"})
    warm = timer.timeit(20) / 20  # files opened, statements prepared: then a first estimate
    count = max(20, int(seconds / max(warm, 1e-7)))
    alone = min(timer.repeat(5, count)) / count * 1e6
    if held == 0:
        return {"alone": alone}
    _allow_files(held)
    try:
        for index in range(held):
            backend.acquire(f"held-{index}")
    except Exception as error:  # out of descriptors, PostgreSQL's lock table: in the notes
        return {"alone": alone, "held_error": f"{type(error).__name__}: {error}"}
    loaded = min(timer.repeat(5, count)) / count * 1e6
    for index in range(held):
        backend.release(f"held-{index}")
    return {"alone": alone, "held": loaded}


def _allow_files(held: int) -> None:
    """Room for a descriptor per held key (the file-per-key libraries keep one open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = held + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        limit = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


class Stamp:
    """The last release: who and when, in a small file every worker maps. Written by the
    holder just before its release, read by the next holder just after its acquire: the
    lock under test orders the two, so the stamp needs no lock of its own."""

    def __init__(self, path: str) -> None:
        import mmap
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 16)

    def write(self) -> None:
        self._map[:16] = os.getpid().to_bytes(8, "little") + now_ns().to_bytes(8, "little")

    def read(self) -> tuple[int, int]:
        data = self._map[:16]
        return int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")


def hot(backend: Backend, stamp_path: str, seconds: float, work: float,
        pause: float) -> dict[str, Any]:
    """Loop on the hot key for ``seconds``: acquire (timed), note the hand-off from another
    process, busy ``work`` seconds, stamp, release, then sleep ``pause`` (0: straight back).
    Returns the pairs made, each hand-off (ns: another process's release to this acquire's
    return) and each wait in acquire (ns)."""
    stamp = Stamp(stamp_path)
    me = os.getpid()
    handoffs: list[int] = []
    waits: list[int] = []
    done = 0
    deadline = now_ns() + int(seconds * 1e9)
    while True:
        asked = now_ns()
        if asked >= deadline:
            break
        backend.acquire("hot")
        got = now_ns()
        waits.append(got - asked)
        releaser, released = stamp.read()
        if releaser not in (0, me) and released >= asked:  # this acquire waited for it
            handoffs.append(got - released)
        until = got + int(work * 1e9)
        while now_ns() < until:
            pass
        stamp.write()
        backend.release("hot")
        done += 1
        if pause:
            time.sleep(pause)
    return {"pairs": done, "handoffs": handoffs, "waits": waits}


class Holders:
    """Forked children, each holding one key until killed (the ``kill`` measurement). The
    lock objects are made in the child: the worker itself holds and opens nothing."""

    def __init__(self, name: str, directory: str, dsn: str, namespace: str) -> None:
        self.args = (name, directory, dsn, namespace)
        self.children: list[int] = []

    def spawn(self, key: str) -> int:
        self.reap()
        ready, told = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child is killed, never returns
            os.close(ready)
            try:
                backend = Backend(*self.args)
                backend.acquire(key)
                os.write(told, b"1")
                while True:
                    signal.pause()
            finally:
                os._exit(1)
        os.close(told)
        try:
            if os.read(ready, 1) != b"1":
                raise RuntimeError(f"a {self.args[0]} holder failed to take {key!r}")
        finally:
            os.close(ready)
        self.children.append(pid)
        return pid

    def reap(self) -> None:
        for pid in self.children:
            os.waitpid(pid, 0)
        self.children.clear()


def main() -> None:
    name, directory, dsn, namespace = sys.argv[1:5]
    holders = Holders(name, directory, dsn, namespace)
    backend: Backend | None = None
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        what = command["do"]
        if what == "spawn-holder":
            answer: Any = holders.spawn(command["key"])
        else:
            if backend is None:
                backend = Backend(name, directory, dsn, namespace)
            if what == "pairs":
                answer = pairs(backend, command["seconds"], command["held"])
            elif what == "hot":
                answer = hot(backend, command["stamp"], command["seconds"], command["work"],
                             command["pause"])
            elif what == "wait":
                print(json.dumps("waiting"), flush=True)
                backend.acquire(command["key"])
                answer = now_ns()
                backend.release(command["key"])
            else:
                raise ValueError(f"unknown command {what!r}")
        print(json.dumps(answer), flush=True)
    holders.reap()


if __name__ == "__main__":
    main()
