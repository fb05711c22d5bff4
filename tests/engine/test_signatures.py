"""``inspect.signature`` (what ``help()`` and IDEs show) reads the compiled core's public
classes and methods, and finds the pure twin's parameters there: names, kinds, defaults.

Annotations are the twin's alone (the core has none), so only parameters are compared."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import lockmgr._core as core
import lockmgr._pure as twin

pytestmark = pytest.mark.compiled

CLASSES = ["LockManager", "RWLockManager", "KeyLock", "AsyncKeyLock"]


def parameters(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]


def instances(engine: Any) -> Iterator[tuple[str, Any]]:
    """One object of each public class, and the managers' ``aio`` views."""
    locks = engine.LockManager()
    rw = engine.RWLockManager()
    yield "LockManager", locks
    yield "RWLockManager", rw
    yield "KeyLock", locks["k"]
    yield "AsyncKeyLock", locks.aio["k"]
    yield "LockManager.aio", locks.aio
    yield "RWLockManager.aio", rw.aio


def public_methods(obj: object) -> dict[str, Callable[..., Any]]:
    return {name: getattr(obj, name) for name in dir(obj)
            if not name.startswith("_") and callable(getattr(obj, name))}


def test_core_classes_show_the_twins_constructor_parameters() -> None:
    assert core.LockManager is not twin.LockManager
    for name in CLASSES:
        assert parameters(getattr(core, name)) == parameters(getattr(twin, name)), name


@pytest.mark.parametrize("what", [name for name, _ in instances(twin)])
def test_core_methods_show_the_twins_parameters(what: str) -> None:
    core_object = dict(instances(core))[what]
    twin_object = dict(instances(twin))[what]
    twin_methods = public_methods(twin_object)
    core_methods = public_methods(core_object)
    assert twin_methods, what
    for name in sorted(twin_methods.keys() & core_methods.keys()):
        assert parameters(core_methods[name]) == parameters(twin_methods[name]), f"{what}.{name}"


@pytest.mark.parametrize("what", [name for name, _ in instances(twin)])
def test_core_methods_carry_the_twins_docstrings(what: str) -> None:
    """``help()`` says the same of either engine: what each call does and raises."""
    core_methods = public_methods(dict(instances(core))[what])
    twin_methods = public_methods(dict(instances(twin))[what])
    differing = [name for name in sorted(twin_methods.keys() & core_methods.keys())
                 if inspect.getdoc(core_methods[name]) != inspect.getdoc(twin_methods[name])]
    assert not differing, f"{what}: the engines' docstrings differ for {differing}"
