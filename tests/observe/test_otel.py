"""lockmgr.otel with the real OpenTelemetry SDK (its in-memory reader), on both engines."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from conftest import PATIENCE, wait_until
from lockmgr._observe import HISTOGRAM_BOUNDS
from lockmgr.otel import instrument


def collect(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """Instrument name -> its data points, from one collection."""
    points: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points.setdefault(metric.name, []).extend(metric.data.data_points)
    return points


def value(points: dict[str, list[Any]], name: str, manager: str = "locks") -> Any:
    (point,) = [p for p in points.get(name, []) if p.attributes == {"lockmgr.manager": manager}]
    return point


@pytest.fixture
def reader() -> Iterator[InMemoryMetricReader]:
    yield InMemoryMetricReader()


@pytest.fixture
def provider(reader: InMemoryMetricReader) -> Iterator[MeterProvider]:
    """A meter provider collected by ``reader`` (a reader serves one provider only)."""
    provider = MeterProvider(metric_readers=[reader])
    yield provider
    provider.shutdown()


def contended_wait(locks: Any) -> None:
    """One wait that is granted: a thread queues behind this thread's hold."""
    locks.acquire("k")
    waiter = threading.Thread(target=lambda: (locks.acquire("k"), locks.release("k")))
    waiter.start()
    wait_until(lambda: locks.stats().waiting == 1, "the waiter queued")
    locks.release("k")
    waiter.join(PATIENCE)
    assert not waiter.is_alive()


def test_counters_gauges_and_the_wait_histogram(impl, reader, provider) -> None:
    locks = impl.LockManager()
    instrument(locks, name="locks", meter_provider=provider)
    locks.acquire("held")
    contended_wait(locks)
    points = collect(reader)
    stats = locks.stats()
    assert value(points, "lockmgr.keys.held").value == stats.held == 1
    assert value(points, "lockmgr.requests.waiting").value == 0
    assert value(points, "lockmgr.acquisitions").value == stats.acquisitions
    assert value(points, "lockmgr.acquisitions.contended").value == stats.contended == 1
    assert value(points, "lockmgr.timeouts").value == stats.timeouts
    assert value(points, "lockmgr.deadlocks").value == 0
    waits = value(points, "lockmgr.wait.duration")
    assert waits.count == 1 and tuple(waits.explicit_bounds) == HISTOGRAM_BOUNDS
    # The same wait the engine measured, read from the clock a moment apart.
    assert abs(waits.sum - locks.metrics().wait_time.sum) < 0.05
    locks.release("held")


def test_task_waits_are_recorded(impl, reader, provider) -> None:
    locks = impl.RWLockManager()
    instrument(locks, name="locks", meter_provider=provider)

    async def main() -> None:
        holds, done = asyncio.Event(), asyncio.Event()

        async def holder() -> None:
            async with locks.aio.write("k"):
                holds.set()
                await done.wait()

        async def reader() -> None:
            async with locks.aio.read("k"):
                pass

        first = asyncio.create_task(holder())
        await holds.wait()
        second = asyncio.create_task(reader())
        while locks.stats().waiting == 0:
            await asyncio.sleep(0.001)
        done.set()
        await asyncio.gather(first, second)

    asyncio.run(main())
    assert value(collect(reader), "lockmgr.wait.duration").count == 1


def test_each_manager_reports_under_its_name(impl, reader, provider) -> None:
    first, second = impl.LockManager(), impl.LockManager(stripes=4)
    instrument(first, name="first", meter_provider=provider)
    instrument(second, name="second", meter_provider=provider)
    first.acquire("a")
    points = collect(reader)
    assert value(points, "lockmgr.keys.held", "first").value == 1
    assert value(points, "lockmgr.keys.held", "second").value == 0
    first.release("a")


def test_uninstrument_and_a_manager_that_is_gone(impl, reader, provider) -> None:
    locks = impl.LockManager()
    instrumentation = instrument(locks, name="locks",
                                 meter_provider=provider)
    instrumentation.uninstrument()
    contended_wait(locks)
    points = collect(reader)
    assert "lockmgr.wait.duration" not in points and "lockmgr.acquisitions" not in points

    other = impl.LockManager()
    instrument(other, name="other", meter_provider=provider)
    watched = weakref.ref(other)
    del other
    gc.collect()
    assert watched() is None  # the instruments do not keep it alive
    assert collect(reader).get("lockmgr.keys.held", []) == []


def test_bad_arguments(impl) -> None:
    with pytest.raises(TypeError, match="lockmgr manager"):
        instrument(object())
    with pytest.raises(TypeError, match="name"):
        instrument(impl.LockManager(), name=7)  # type: ignore[arg-type]


def test_a_clear_import_error_without_opentelemetry() -> None:
    script = (
        "import sys; sys.modules['opentelemetry'] = None\n"
        "try:\n    import lockmgr.otel\n"
        "except ImportError as error:\n    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=PATIENCE)
    assert done.returncode == 0, done.stderr
    assert "pip install 'lockmgr[otel]'" in done.stdout


def test_one_name_per_manager_on_a_provider(impl, provider) -> None:
    accounts, kept = impl.LockManager(), impl.LockManager()
    first = instrument(accounts, name="accounts", meter_provider=provider)
    with pytest.raises(ValueError, match="'accounts'"):
        instrument(kept, name="accounts", meter_provider=provider)
    first.uninstrument()
    instrument(kept, name="accounts", meter_provider=provider)
