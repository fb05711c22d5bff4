"""What the tests of signal masks share: the calling thread's mask, and SIGUSR1 made to
raise on the main thread for a test (``usr1_raises``, a fixture: import it into the module)."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest


class Interrupted(Exception):
    """What SIGUSR1's handler raises under ``usr1_raises``."""


def mask_now() -> set[int]:
    """The calling thread's blocked signals."""
    return set(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, [])))


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted


@pytest.fixture
def usr1_raises() -> Iterator[None]:
    """SIGUSR1 raises ``Interrupted`` on the main thread; the mask and handler put back."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handler = signal.signal(signal.SIGUSR1, _raise_interrupted)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        signal.signal(signal.SIGUSR1, handler)
