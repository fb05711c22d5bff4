"""SIGTERM as Ctrl-C, for code that starts servers: the benchmark's redis-server and the
tests' PostgreSQL servers (``tests/pgserver.py``) stop theirs in a ``finally``."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the block runs, SIGTERM (a job's time limit, ``timeout``, ``kill``) raises
    KeyboardInterrupt in the main thread, as Ctrl-C does, so that what the block started
    (a redis-server, a PostgreSQL server) is stopped by its ``finally`` rather than left
    running. (Not SystemExit: pytest fails the running test on it and goes on, while
    KeyboardInterrupt ends the run and tears the fixtures down.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:  # None: a handler not installed from Python, which is as good as the default
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
