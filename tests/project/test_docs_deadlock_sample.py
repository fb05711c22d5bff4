"""The ``DeadlockError`` sample of docs/semantics.md is the message the engines raise.

The sample is the ``lockmgr.DeadlockError: ...`` line of the ```text block after the
``<!-- deadlock-sample: ... -->`` comment; its thread idents are shortened (``140…``), so
they stand for any ident. The same two-thread cycle is made here on each engine, and its
message must read as the sample does.
"""

from __future__ import annotations

import pathlib
import re
import threading
from types import ModuleType

from conftest import TESTS, wait_until

import lockmgr

SEMANTICS = pathlib.Path(TESTS).parent / "docs" / "semantics.md"
PREFIX = "lockmgr.DeadlockError: "


def documented_sample() -> str:
    """The message the docs show, after the ``deadlock-sample`` marker."""
    lines = SEMANTICS.read_text(encoding="utf-8").splitlines()
    start = next(index for index, line in enumerate(lines) if "<!-- deadlock-sample:" in line)
    sample = next(line for line in lines[start:] if line.startswith(PREFIX))
    return sample.removeprefix(PREFIX)


def as_pattern(sample: str) -> str:
    """The sample with each shortened ident (``thread 140…``) standing for any ident."""
    return r"thread \d+".join(re.escape(part) for part in re.split(r"thread \d+…", sample))


def test_the_documented_deadlock_message_is_the_one_raised(impl: ModuleType) -> None:
    """Thread 1 holds A and waits for B; thread 2 holds B and asks for A: thread 2 gets
    the error, naming itself first."""
    locks = impl.LockManager()
    first_holds_a, second_holds_b = threading.Event(), threading.Event()
    finished = threading.Event()

    def first() -> None:
        with locks["A"]:
            first_holds_a.set()
            second_holds_b.wait()
            with locks["B"]:
                pass
        finished.set()

    thread = threading.Thread(target=first)
    thread.start()
    try:
        first_holds_a.wait()
        with locks["B"]:
            second_holds_b.set()
            wait_until(lambda: any(state.waiters for state in locks.snapshot()),
                       "thread 1 waits for B")
            try:
                locks.acquire("A")
            except lockmgr.DeadlockError as error:
                message = str(error)
            else:
                raise AssertionError("no DeadlockError")
    finally:
        thread.join()
    assert finished.is_set()
    sample = documented_sample()
    assert re.fullmatch(as_pattern(sample), message), f"docs: {sample}\nreal: {message}"
