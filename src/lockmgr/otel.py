"""OpenTelemetry metrics for a lock manager (the ``otel`` extra: ``pip install lockmgr[otel]``).

>>> from lockmgr import LockManager
>>> from lockmgr.otel import instrument
>>> locks = LockManager()
>>> instrumented = instrument(locks, name="accounts")  # doctest: +SKIP

registers, on the given meter provider (the global one by default), instruments that every
reader or exporter of that provider collects:

- ``lockmgr.keys.held`` and ``lockmgr.requests.waiting``: observable gauges (``stats()``);
- ``lockmgr.acquisitions``, ``lockmgr.acquisitions.contended``, ``lockmgr.timeouts`` and
  ``lockmgr.deadlocks``: observable counters (monotonic totals since the manager was made);
- ``lockmgr.wait.duration``: a histogram (seconds) of waits that were granted, recorded by the
  waiting thread or task as its wait ends, with lockmgr's own bucket bounds as the advice.

Each measurement carries the attribute ``lockmgr.manager`` set to ``name``. The instruments
are made once per meter provider and report every manager instrumented on it; they keep
only a weak reference to each: a manager that is gone reports nothing more.
``Instrumentation.uninstrument()`` stops reporting one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry.metrics import CallbackOptions, Observation
except ImportError as error:  # pragma: no cover - tested in a subprocess without the package
    raise ImportError(
        "lockmgr.otel needs the OpenTelemetry API: pip install 'lockmgr[otel]' "
        "(or opentelemetry-api)"
    ) from error

from importlib.metadata import PackageNotFoundError, version

from ._observe import HISTOGRAM_BOUNDS

if TYPE_CHECKING:
    from ._contract import Engine

__all__ = ["Instrumentation", "instrument"]

_STATS = (
    ("lockmgr.acquisitions", "acquisitions", "{acquisition}",
     "Successful acquisitions, reentrant ones included"),
    ("lockmgr.acquisitions.contended", "contended", "{acquisition}",
     "Acquisitions that had to wait"),
    ("lockmgr.timeouts", "timeouts", "{acquisition}",
     "Acquisitions that gave up: timed out, or a try-lock that found the key taken"),
    ("lockmgr.deadlocks", "deadlocks", "{acquisition}",
     "Acquisitions refused because waiting would have deadlocked"),
)


class _Instruments:
    """One meter provider's lockmgr instruments (a provider keeps the first instrument of a
    name), reporting every manager instrumented on it."""

    def __init__(self, meter: Any) -> None:
        self.guard = threading.Lock()
        self.members: list[Instrumentation] = []  # under guard
        meter.create_observable_gauge(
            "lockmgr.keys.held", [self._observe("held")], unit="{key}",
            description="Keys held (with stripes: stripes)")
        meter.create_observable_gauge(
            "lockmgr.requests.waiting", [self._observe("waiting")], unit="{request}",
            description="Requests waiting in a queue")
        for instrument_name, field, unit, description in _STATS:
            meter.create_observable_counter(instrument_name, [self._observe(field)], unit=unit,
                                            description=description)
        self.waits = meter.create_histogram(
            "lockmgr.wait.duration", unit="s",
            description="How long contended acquisitions waited before they were granted",
            explicit_bucket_boundaries_advisory=list(HISTOGRAM_BOUNDS))

    def _observe(self, field: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(options: CallbackOptions) -> Iterable[Observation]:
            with self.guard:
                members = list(self.members)
            observations = []
            for member in members:
                manager = member.manager()
                if manager is not None:
                    observations.append(Observation(getattr(manager.stats(), field),
                                                    member.attributes))
            return observations

        return observe

    def join(self, member: Instrumentation) -> None:
        with self.guard:
            self.members = [other for other in self.members if other.manager() is not None]
            if any(other.name == member.name for other in self.members):
                raise ValueError(f"a manager named {member.name!r} is instrumented on this "
                                 "meter provider already")
            self.members.append(member)

    def leave(self, member: Instrumentation) -> None:
        with self.guard:
            self.members = [other for other in self.members if other is not member]


_instruments: weakref.WeakKeyDictionary[Any, _Instruments] = weakref.WeakKeyDictionary()
_instruments_guard = threading.Lock()


class Instrumentation:
    """What ``instrument`` registered for one manager."""

    def __init__(self, manager: Any, name: str, instruments: _Instruments) -> None:
        self.name = name
        self.attributes = {"lockmgr.manager": name}
        self.manager = weakref.ref(manager)
        # PostgreSQL managers wait in their in-process engine.
        engine: Engine = getattr(manager, "_engine", manager)
        self._engine = weakref.ref(engine)
        self._instruments = instruments
        instruments.join(self)
        self._observer = self._record_wait  # one bound method: removed by identity
        engine._add_wait_observer(self._observer)

    def _record_wait(self, seconds: float) -> None:
        self._instruments.waits.record(seconds, self.attributes)

    def uninstrument(self) -> None:
        """Stop reporting this manager (again: nothing more happens). Raises nothing."""
        self._instruments.leave(self)
        engine = self._engine()
        if engine is not None:
            engine._remove_wait_observer(self._observer)


def instrument(manager: Any, *, name: str = "lockmgr", meter_provider: Any = None) -> Instrumentation:
    """Report ``manager`` (any lockmgr manager, PostgreSQL ones included) through
    OpenTelemetry, as ``name`` (one name per manager on a meter provider); ``meter_provider``
    defaults to the global one.

    Raises TypeError for something that is not a lockmgr manager or a ``name`` that is not
    a str, and ValueError if a manager of that ``name`` is instrumented on that meter
    provider already."""
    if not callable(getattr(manager, "stats", None)) or not hasattr(
            getattr(manager, "_engine", manager), "_add_wait_observer"):
        raise TypeError(f"instrument() takes a lockmgr manager, not {type(manager).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    provider = meter_provider if meter_provider is not None else _metrics.get_meter_provider()
    with _instruments_guard:
        instruments = _instruments.get(provider)
        if instruments is None:
            instruments = _instruments[provider] = _Instruments(
                provider.get_meter("lockmgr", _version()))
    return Instrumentation(manager, name, instruments)


def _version() -> str | None:
    try:
        return version("lockmgr")
    except PackageNotFoundError:  # pragma: no cover - run from a source tree
        return None
