"""The ``DeadlockError`` sample of docs/semantics.md is the message the engines raise.

The sample is the ``lockmgr.DeadlockError: ...`` line of the ```text block after the
``<!-- deadlock-sample: ... -->`` comment, with the lines that continue it; its threads are
written ``thread 'NAME' (ident 140…)``, which stands for any thread's name and ident. The same two-thread cycle is made here on each engine, and its
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
    first = next(index for index in range(start, len(lines)) if lines[index].startswith(PREFIX))
    sample = [lines[first].removeprefix(PREFIX)]
    for line in lines[first + 1:]:
        if line.startswith((">>>", "```", "#")):
            break
        sample.append(line.strip())
    return " ".join(sample)


THREAD = re.compile(r"thread '[^']*' \(ident \d+…\)")


def as_pattern(sample: str) -> str:
    """The sample with each thread (``thread 'NAME' (ident 140…)``) standing for any."""
    assert THREAD.search(sample), f"the sample names no thread as the engines do: {sample}"
    return r"thread '[^']*' \(ident \d+\)".join(
        re.escape(part) for part in THREAD.split(sample))


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
