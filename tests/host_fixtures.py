"""The host backend's fixtures: a lock directory per test, the manager bound to the engine
under test (``impl``) and to each kernel mechanism, and real child processes to share it with
(``HostProcess``)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from lockmgr.host import _managers

#: How long a test waits for a child's answer before it fails (a hang bound, not a timing).
PATIENCE = 60.0

SRC = str(Path(__file__).resolve().parents[2] / "src")

_CHILD = r"""
import json, os, signal, sys, threading, time, warnings
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
from lockmgr.host import HostLockManager, HostRWLockManager
import lockmgr
space = {"os": os, "signal": signal, "sys": sys, "threading": threading, "time": time,
         "warnings": warnings, "lockmgr": lockmgr, "HostLockManager": HostLockManager,
         "HostRWLockManager": HostRWLockManager}
warnings.simplefilter("always")
exec(sys.argv[1], space)
print(json.dumps({"ready": os.getpid(), "engine": lockmgr.implementation}), flush=True)
for line in sys.stdin:
    command = json.loads(line)
    try:
        try:
            code = compile(command, "<command>", "eval")
        except SyntaxError:
            exec(compile(command, "<command>", "exec"), space)
            answer = {"value": None}
        else:
            answer = {"value": eval(code, space)}
    except BaseException as error:  # the parent asserts on it
        answer = {"error": type(error).__name__, "message": str(error)}
    print(json.dumps(answer, default=repr), flush=True)
"""


class HostProcess:
    """A real child process (``subprocess``, so spawned) running ``setup``, then each
    command sent to it (an expression, answered with its value, or statements) in order on
    its main thread. ``ask`` sends one and waits for its answer; ``send`` and ``answer``
    split the two, for a command that blocks."""

    def __init__(self, setup: str, engine: str) -> None:
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        env.pop("LOCKMGR_NO_EXTENSIONS", None)
        if engine == "python":
            env["LOCKMGR_NO_EXTENSIONS"] = "1"
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, setup], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        ready = self._next()
        self.pid: int = ready["ready"]
        assert ready["engine"] == ("python" if engine == "python" else "cython"), ready

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")

    def _next(self, limit: float = PATIENCE) -> Any:
        line = self._lines.get(timeout=limit)
        if not line:
            raise AssertionError(f"the child ended: exit status {self.process.wait(PATIENCE)}")
        return json.loads(line)

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self, limit: float = PATIENCE) -> Any:
        """The next command's value; AssertionError naming the error it raised."""
        answer = self._next(limit)
        if "error" in answer:
            raise AssertionError(f"{answer['error']}: {answer['message']}")
        return answer["value"]

    def error(self, limit: float = PATIENCE) -> str:
        """The name of the error the next command raised."""
        answer = self._next(limit)
        assert "error" in answer, answer
        return str(answer["error"])

    def answered(self) -> bool:
        return not self._lines.empty()

    def ask(self, command: str) -> Any:
        self.send(command)
        return self.answer()

    def finish(self) -> int:
        """Close its input (it ends) and return its exit status."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        return self.process.wait(PATIENCE)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(PATIENCE)

    def close(self) -> None:
        """Kill it if it still runs, and close its pipes."""
        if self.process.poll() is None:
            self.kill()
        if self.process.stdin is not None:
            try:
                self.process.stdin.close()
            except BrokenPipeError:  # (it died with input unread)
                pass
        self._reader.join(PATIENCE)
        if self.process.stdout is not None:
            self.process.stdout.close()


def counted(children: Any, lock_dir: str, bump: str, command: str, processes: int) -> int:
    """The value of a counter file (next to ``lock_dir``, from 0) once ``processes`` children
    defining ``bump(counter)`` (a non-atomic read-modify-write of it under a lock) have each
    run ``command``."""
    counter = os.path.join(os.path.dirname(lock_dir), "counter")
    with open(counter, "w") as file:
        file.write("0")
    workers = [children(f"counter = {counter!r}\n" + bump) for _ in range(processes)]
    for worker in workers:
        worker.send(command)
    for worker in workers:
        assert worker.answer() is None
    with open(counter) as file:
        return int(file.read())


@pytest.fixture
def host_engine(impl: ModuleType, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Run the host managers over the in-process engine under test."""
    monkeypatch.setattr(_managers, "LockManager", impl.LockManager)
    monkeypatch.setattr(_managers, "RWLockManager", impl.RWLockManager)
    return impl


@pytest.fixture(params=["ofd", "posix"])
def mechanism(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def lock_dir(tmp_path: Path) -> str:
    return str(tmp_path / "locks")


@pytest.fixture
def children(impl: ModuleType, lock_dir: str, mechanism: str) -> Iterator[Any]:
    """Make child processes sharing ``lock_dir`` (``locks``: a HostLockManager, ``rw``: a
    HostRWLockManager of it); each is killed at the end if still running."""
    made: list[HostProcess] = []
    engine = "python" if impl.__name__.endswith("_pure") else "cython"

    def make(extra: str = "") -> HostProcess:
        setup = (f"locks = HostLockManager({lock_dir!r}, mechanism={mechanism!r})\n"
                 f"rw = HostRWLockManager({lock_dir!r}, mechanism={mechanism!r}, namespace='rw')\n"
                 + extra)
        child = HostProcess(setup, engine)
        made.append(child)
        return child

    yield make
    for child in made:
        child.close()
