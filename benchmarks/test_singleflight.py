"""Singleflight's paths, both engines beside the hand-written dict of futures: a miss (a call
nobody else asks for) and a hit (joining a call whose result is ready: the caller's own
cost, without the sleep). ``lockmgr-bench --scenario singleflight`` adds the 1,000-thread
stampede.

Run: pip install -e '.[bench]' && pytest benchmarks --benchmark-group-by=group
"""

from __future__ import annotations

import importlib

import pytest

from lockmgr._singleflight import singleflight_on
from lockmgr.bench._singleflight import DictOfFutures, FlightSubject, _futures, _lockmgr

ENGINES = ["lockmgr._core", "lockmgr._pure"]


@pytest.fixture(params=[*ENGINES, "dict-of-futures"], ids=["cython", "python", "dict-of-futures"])
def subject(request: pytest.FixtureRequest) -> FlightSubject:
    if request.param == "dict-of-futures":
        return _futures()
    return _lockmgr(singleflight_on(importlib.import_module(request.param)))()


def _calls(subject: FlightSubject, key: str):  # type: ignore[no-untyped-def]
    call = subject.call

    def run() -> None:
        for _ in range(1000):
            call(key, int)

    return run


@pytest.mark.benchmark(group="singleflight miss x1000")
def test_miss(benchmark, subject) -> None:  # type: ignore[no-untyped-def]
    benchmark(_calls(subject, "cold"))


@pytest.mark.benchmark(group="singleflight hit x1000")
def test_hit(benchmark, subject) -> None:  # type: ignore[no-untyped-def]
    subject.ready("ready", "payload")
    benchmark(_calls(subject, "ready"))


def test_the_hand_written_version_shares_a_call() -> None:
    flights = DictOfFutures()
    flights.ready("k", "payload")
    assert flights.call("k", int) == "payload"
