"""Helpers of the PostgreSQL tests: what the server holds, child processes that use the
backend, the asyncio tests' loop helpers, and a clean-up made slow."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest

import pgserver  # noqa: F401  (first: it skips its importer where psycopg cannot load libpq)
import psycopg
from conftest import PATIENCE
from lockmgr import postgres
from lockmgr.postgres._aio_link import _AsyncLink
from lockmgr.postgres._sql import _GRANTED_ADVISORY


def own_sessions_locks(dsn: str) -> int:
    """Advisory locks held by the server sessions of this process's own connections (found
    by their client ports: this process's sockets connected to the server's port)."""
    server_port = int(dsn.rsplit(":", 1)[1].split("/")[0])
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    with open("/proc/self/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if fields[9] in inodes and int(fields[2].split(":")[1], 16) == server_port:
                ports.append(int(fields[1].split(":")[1], 16))
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute("SELECT count(*) FROM pg_locks JOIN pg_stat_activity USING (pid)"
                            " WHERE locktype = 'advisory' AND client_port = ANY(%s)",
                            (ports,)).fetchone()
    return int(row[0]) if row else 0


_children: list[subprocess.Popen[str]] = []


def race_timeouts_against_a_holder(
        hold: Callable[[], AbstractContextManager[Any]],
        attempt: Callable[[int, float], bool],
        while_held: Callable[[Any], None] = lambda lease: None,
        each: int = 10) -> collections.Counter[bool]:
    """Make timed ``attempt(number, timeout)`` calls (timeouts of 1-4 ms) while another
    thread loops ``with hold() as lease: while_held(lease)`` for 0-3 ms at a time, until
    each outcome (True: granted, False: timed out) has come ``each`` times, so that timeouts
    race grants. Starts once the other thread first holds (its connecting can take longer
    than the attempts); bounded by PATIENCE. Returns the outcomes' counts."""
    holding = threading.Event()
    stop = threading.Event()
    failures: list[BaseException] = []

    def holder() -> None:
        rng = random.Random(3)
        try:
            while not stop.is_set():
                with hold() as lease:
                    while_held(lease)
                    holding.set()
                    time.sleep(rng.random() * 0.003)
        except BaseException as error:  # a leaked lock would starve it: LockTimeout
            failures.append(error)
            holding.set()

    thread = threading.Thread(target=holder)
    thread.start()
    outcomes: collections.Counter[bool] = collections.Counter()
    rng = random.Random(5)
    try:
        assert holding.wait(PATIENCE), "the holder never held"
        deadline = time.monotonic() + PATIENCE
        number = 0
        while min(outcomes[True], outcomes[False]) < each and time.monotonic() < deadline:
            outcomes[attempt(number, rng.choice([0.001, 0.002, 0.003, 0.004]))] += 1
            number += 1
    finally:
        stop.set()
        thread.join(PATIENCE)
    assert not thread.is_alive() and not failures, failures
    assert min(outcomes[True], outcomes[False]) >= each, outcomes
    return outcomes


def held_on_server(dsn: str, manager: Any, key: object) -> bool:
    """Whether any session holds ``key``, asked on a connection of the test's own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(f"SELECT EXISTS (SELECT 1 FROM {_GRANTED_ADVISORY} %s)",
                           (manager.advisory_key(key),)).fetchone()
    return bool(row and row[0])


CHILD = """
import json, os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
from lockmgr import postgres, LockLost, DeadlockError
locks = postgres.{cls}(os.environ["DSN"], namespace=os.environ["NAMESPACE"])
def say(**what):
    print(json.dumps(what), flush=True)
{body}
"""


def child(dsn: str, namespace: str, body: str, cls: str = "PgLockManager",
          pure: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "DSN": dsn, "NAMESPACE": namespace,
           "LOCKMGR_NO_EXTENSIONS": "1" if pure else "", **(env or {})}
    code = CHILD.format(cls=cls, body=textwrap.dedent(body))
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env)
    _children.append(process)
    return process


def expect(process: subprocess.Popen[str], **what: object) -> dict[str, Any]:
    """The child's next JSON line, which must contain ``what``. A child that says nothing
    within PATIENCE * 3 seconds is killed and reaped (a hung child must fail its own test,
    not leave a pipe for a later test's garbage collection to complain about)."""
    assert process.stdout is not None
    stdout = process.stdout
    said: list[str] = []
    reader = threading.Thread(target=lambda: said.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(PATIENCE * 3)
    if reader.is_alive():
        process.kill()
        reader.join(PATIENCE)  # the kill closed its end: the reader sees the end of file
        _, err = process.communicate(timeout=PATIENCE)  # reaps it and closes every pipe
        raise AssertionError(f"the child said nothing within {PATIENCE * 3:g} s; "
                             f"stderr: {err[-4000:]}")
    line = said[0]
    assert line, process.stderr.read() if process.stderr else "no output"
    said: dict[str, Any] = json.loads(line)
    assert {key: said.get(key) for key in what} == what, said
    return said


def finish(process: subprocess.Popen[str]) -> None:
    try:
        out, err = process.communicate("go\n", timeout=PATIENCE)
    finally:
        process.kill()
    assert process.returncode == 0, err


def _waiting_on_server(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                           " AND NOT granted").fetchone()
    return int(row[0]) if row else 0


def terminate_holder(dsn: str, manager: Any, key: object) -> None:
    """End the server session holding ``key`` (as an administrator or a failover would)."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        pids = [row[0] for row in admin.execute(
            f"SELECT pid FROM {_GRANTED_ADVISORY} %s", (manager.advisory_key(key),))]
        assert pids, f"no session holds {key!r}"
        for pid in pids:
            admin.execute("SELECT pg_terminate_backend(%s, %s)", (pid, int(PATIENCE * 1000)))


async def until(condition: Callable[[], bool], what: str) -> None:
    """Let the loop run until ``condition`` (a real state) holds."""
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.002)


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(main(), PATIENCE * 3))


def in_loop_thread(main: Callable[[], Awaitable[None]]
                   ) -> tuple[threading.Thread, list[BaseException]]:
    """``run(main)`` in a thread of its own, started (the test's thread goes on beside its
    tasks); what it raised goes to the list."""
    failures: list[BaseException] = []

    def body() -> None:
        try:
            run(main)
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=body)
    thread.start()
    return thread, failures


HOLDER = """
locks.acquire("k")
say(held=True)
sys.stdin.readline()
locks.release("k")
"""


def quietly_collect() -> list[str]:
    """Collect the garbage (stranded tasks whose last reference the caller dropped); what
    their coroutines' finalization raised (sys.unraisablehook) is returned, not printed."""
    raised: list[str] = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda info: raised.append(repr(info.exc_value))
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous
    return raised


def strand_a_holder(locks: postgres.PgLockManager[Any], key: str,
                    lock: contextlib.AbstractAsyncContextManager[Any] | None = None,
                    before_close: Callable[[], object] = lambda: None,
                    ) -> asyncio.Task[None]:
    """A task holding ``key`` (in process and on the server) whose loop is closed while it
    is pending: what asyncio.run leaves when its shutdown is cut short by another Ctrl-C.
    It holds it with ``async with locks.aio.hold(key)``, or ``async with lock`` (as
    ``locks.aio[key]``: one object, which other tasks may use too). ``before_close()``
    runs once the task holds it, before the loop is closed."""
    loop = asyncio.new_event_loop()

    async def until_held() -> asyncio.Task[None]:
        started = asyncio.Event()

        async def holds() -> None:
            async with locks.aio.hold(key) if lock is None else lock:
                started.set()
                await asyncio.sleep(3600)

        task = asyncio.create_task(holds())
        await started.wait()
        return task

    try:
        task = loop.run_until_complete(asyncio.wait_for(until_held(), PATIENCE))
        before_close()
        return task
    finally:
        loop.close()


def slow_abort(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """A clean-up that takes ``seconds`` longer (as over a slow network): only widens the
    window in which the other cancellations land, changes nothing else."""
    original = _AsyncLink.abort

    async def abort(self: _AsyncLink) -> None:
        await asyncio.sleep(seconds)
        await original(self)

    monkeypatch.setattr(_AsyncLink, "abort", abort)


class ScriptedWorker:
    """A stand-in for ``_distributed.Worker`` answering from a script (no process):
    the second one gets the key a moment after the pause ended, before the first, just
    resumed, has written and released — as python-redis-lock's waiter does when its 2-second
    BLPOP ends 0.5 s before the 2.5-second pause would, on a machine busy enough to make up
    the difference (the README's own runs measured 0.50 s of margin)."""

    def __init__(self, name: str, log: dict[str, Any]) -> None:
        self.name = name
        self.log = log
        self.answers: list[Any] = []

    def send(self, command: str, *args: Any) -> None:
        if command == "contend":
            self.answers.append(time.monotonic())  # its try failed: it is waiting

    def answered_within(self, seconds: float) -> bool:
        time.sleep(max(0.0, seconds))
        return False  # it gets in only after the pause

    def receive(self, limit: float = PATIENCE) -> Any:
        if self.answers:
            return self.answers.pop(0)
        return self.log["second acquired"]

    def call(self, command: str, *args: Any, limit: float = PATIENCE) -> Any:
        now = time.monotonic()
        if command == "acquire":
            return now
        if command == "write":
            if self.name == "first":  # the second one acquires as the first resumes
                self.log["second acquired"] = now - 0.001
            return True, now
        if command == "release":
            return now, self.name == "second"  # the first one's lease ran out
        raise AssertionError(command)

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass
