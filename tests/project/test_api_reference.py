"""The API reference (docs/api.md) names every public name: each module's ``__all__`` and
every public method and attribute of each public class, of lockmgr, lockmgr.postgres and
lockmgr.otel.

A name counts as documented when docs/api.md has an autodoc directive for it
(``.. autoclass:: lockmgr.LockManager``) or lists it in the ``:members:`` of its class's
directive (an explicit list: a member added to a class, and to no list, fails here rather
than going missing from the site). A name a module re-exports from another (``lockmgr.postgres.LockLost``
is ``lockmgr.LockLost``) counts when the page names it. What a class has from a built-in
base (an exception's ``args``, ``TimeoutError``'s ``errno``) is Python's, not lockmgr's.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
from collections.abc import Iterator
from types import ModuleType

import pytest
from conftest import TESTS

API = pathlib.Path(TESTS).parent / "docs" / "api.md"
MODULES = ("lockmgr", "lockmgr.postgres", "lockmgr.otel")
DIRECTIVE = re.compile(r"^\.\. auto(?P<kind>\w+):: (?P<name>[\w.]+)")
OPTION = re.compile(r"^   :(?P<option>[\w-]+):\s*(?P<value>.*)$")
CONTINUED = re.compile(r"^ {4,}[\w, ]+$")


def public_names() -> Iterator[tuple[str, object]]:
    """Each public name with its object: the modules' ``__all__``, then their classes'."""
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            yield f"{module_name}.{name}", value
            if inspect.isclass(value):
                builtin = {attribute for base in value.__mro__ if base.__module__ == "builtins"
                           for attribute in dir(base)}
                for attribute in dir(value):
                    if not attribute.startswith("_") and attribute not in builtin:
                        yield f"{module_name}.{name}.{attribute}", value


def directives() -> dict[str, dict[str, str]]:
    """Each autodoc directive of docs/api.md: its target's name, with its options (a
    ``:members:`` list may go on over lines indented deeper than the option)."""
    found: dict[str, dict[str, str]] = {}
    options: dict[str, str] | None = None
    option = None
    for line in API.read_text(encoding="utf-8").splitlines():
        directive = DIRECTIVE.match(line)
        given = OPTION.match(line)
        if directive:
            options = found[directive["name"]] = {}
        elif given and options is not None:
            option = given["option"]
            options[option] = given["value"]
        elif CONTINUED.match(line) and options is not None and option is not None:
            options[option] += " " + line.strip()
        else:
            options = option = None
    return found


def members(options: dict[str, str]) -> list[str]:
    return [name.strip() for name in options.get("members", "").split(",") if name.strip()]


def documented_names() -> set[str]:
    """The names docs/api.md documents: its directives' and their explicit members."""
    return {f"{target}.{member}" if member else target
            for target, options in directives().items() for member in ["", *members(options)]}


def test_the_api_reference_names_every_public_name() -> None:
    documented = documented_names()
    text = API.read_text(encoding="utf-8")
    missing = []
    for name, value in public_names():
        if name in documented:
            continue
        _, _, short = name.rpartition(".")
        reexported = inspect.isclass(value) and f"{value.__module__}.{short}" != name
        if not (reexported and f"`{name}`" in text):
            missing.append(name)
    assert not missing, f"docs/api.md does not document: {', '.join(missing)}"


@pytest.mark.parametrize("module_name", MODULES)
def test_every_module_named_has_public_names(module_name: str) -> None:
    """The lists this test walks are there (a module without ``__all__`` would pass empty)."""
    assert importlib.import_module(module_name).__all__


def test_every_member_listed_is_one_autodoc_shows() -> None:
    """autodoc leaves out, without a warning, a listed member that a base class defines
    unless the directive has ``:inherited-members:``, and one without a docstring unless
    it has ``:undoc-members:``: the list alone does not make the page complete. (A listed
    name autodoc cannot find at all is a warning, which fails the docs build.)"""
    left_out = []
    for target, options in directives().items():
        if not members(options):
            continue
        module_name, _, name = target.rpartition(".")
        owner = getattr(importlib.import_module(module_name), name)
        for member in members(options):
            if not hasattr(owner, member):  # a dataclass field: its docs are the source's
                continue
            inherited = member not in vars(owner)
            undocumented = not inspect.getdoc(inspect.getattr_static(owner, member, None))
            if (inherited and "inherited-members" not in options) or (
                    undocumented and "undoc-members" not in options):
                left_out.append(f"{target}.{member}")
    assert not left_out, f"docs/api.md lists them, autodoc leaves them out: {left_out}"


def _calls(module_names: tuple[str, ...]) -> Iterator[tuple[str, object]]:
    """The public functions and methods among ``public_names`` of ``module_names``, the
    compiled core's (method descriptors) included."""
    for name, value in public_names():
        if not name.startswith(tuple(f"{module}." for module in module_names)):
            continue
        if name.rpartition(".")[0] in module_names:  # a module's own name
            if inspect.isfunction(value):
                yield name, value
            continue
        member = inspect.getattr_static(value, name.rpartition(".")[2])
        if inspect.isfunction(member) or inspect.ismethoddescriptor(member):
            yield name, member


def _engine_calls(engine: ModuleType) -> Iterator[tuple[str, object]]:
    """An engine's public calls: its classes' methods, and the methods it lends the
    managers' ``aio`` views (``locks.aio.acquire`` is the engine's ``_task_acquire``)."""
    for class_name in ENGINE_CLASSES:
        owner = getattr(engine, class_name)
        for name in dir(owner):
            member = inspect.getattr_static(owner, name)
            if not name.startswith("_") and (
                    inspect.isfunction(member) or inspect.ismethoddescriptor(member)):
                yield f"{class_name}.{name}", member
    for view_name, view in (("LockManager.aio", engine.LockManager().aio),
                            ("RWLockManager.aio", engine.RWLockManager().aio),
                            ("SemaphoreManager(1).aio", engine.SemaphoreManager(1).aio),
                            ("SemaphoreManager(2).aio", engine.SemaphoreManager(2).aio)):
        for name in view.__slots__:  # the engine's methods, bound (see lockmgr._aio)
            yield f"{view_name}.{name}", getattr(view, name)


#: The engines' public classes: the compiled core's and the pure twin's (whose AsyncKeyLock
#: is lockmgr._aio's).
ENGINE_CLASSES = ("LockManager", "RWLockManager", "SemaphoreManager", "KeyLock", "AsyncKeyLock")


def _silent(calls: Iterator[tuple[str, object]]) -> list[str]:
    return [name for name, call in calls
            if not re.search(r"\braises\b", inspect.getdoc(call) or "", re.IGNORECASE)]


def test_every_public_call_in_python_says_what_it_raises() -> None:
    """Its docstring says what it raises ("Raises nothing" included, or "raises what
    ``acquire`` raises"): every call of lockmgr.postgres and lockmgr.otel, and of lockmgr's
    asyncio views and metrics (and of the engine lockmgr imported: the next test checks
    both)."""
    silent = _silent(_calls(MODULES))
    assert not silent, f"no word on what they raise: {', '.join(silent)}"


def test_every_public_call_of_an_engine_says_what_it_raises(impl: ModuleType) -> None:
    """The same for each engine: LockManager, RWLockManager, SemaphoreManager, KeyLock,
    AsyncKeyLock and the methods the ``aio`` views bind."""
    calls = list(_engine_calls(impl))
    assert len(calls) > 40, calls  # the walk found the classes' methods
    silent = _silent(iter(calls))
    assert not silent, f"no word on what they raise: {', '.join(silent)}"
