"""Both engines keep the engine contract (``lockmgr._contract``) name for name.

mypy holds the pure twin to the protocols (``_contract`` assigns the twin's module and
classes to them); the compiled core has no annotations, so this compares, for both
engines, every member the protocols name: it exists, it is a method where the protocol has
a method and an attribute where it has a property, and its parameters have the protocol's
names, kinds and defaults (an engine may add trailing parameters that have defaults). The
core's methods carry their signatures in ``__text_signature__`` (``embedsignature`` in
``lockmgr_core.pyx``)."""

from __future__ import annotations

import ast
import inspect
from types import ModuleType
from typing import Any, NamedTuple

import pytest

from lockmgr import _contract

#: typing's own members of a Protocol class, not the contract's.
TYPING_MEMBERS = {
    "__module__", "__doc__", "__dict__", "__weakref__", "__parameters__", "__orig_bases__",
    "__init__", "__abstractmethods__", "__annotations__", "__slots__", "__qualname__",
    "__subclasshook__", "__protocol_attrs__", "__non_callable_proto_members__",
    "__callable_proto_members_only__",  # 3.12's
    "__type_params__", "__firstlineno__", "__static_attributes__", "__class_getitem__",
    "_is_protocol", "_is_runtime_protocol", "_abc_impl", "__annotate__", "__annotate_func__",
    "__annotations_cache__",
}

MISSING = object()


class Param(NamedTuple):
    name: str
    kind: str  # "positional", "keyword" or "either"; "*args", "**kwargs"
    default: object  # MISSING, or the default's source text


def members(protocol: type) -> dict[str, Any]:
    """The members a protocol declares, its protocol bases' included."""
    found: dict[str, Any] = {}
    for cls in reversed(protocol.__mro__):
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__module__ == "typing":
            continue
        found.update((name, value) for name, value in vars(cls).items()
                     if name not in TYPING_MEMBERS)
    return found


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "either",
    inspect.Parameter.KEYWORD_ONLY: "keyword",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def _from_signature(signature: inspect.Signature) -> list[Param]:
    return [Param(p.name, _KINDS[p.kind],
                  MISSING if p.default is inspect.Parameter.empty else repr(p.default))
            for p in signature.parameters.values()]


def _from_text_signature(text: str) -> list[Param]:
    """A builtin's ``__text_signature__`` (``($self, key, blocking=True, timeout=FOREVER)``):
    its defaults may name C constants, which ``inspect.signature`` cannot evaluate."""
    arguments = ast.parse(f"def f{text.replace('$', '')}: pass").body[0].args  # type: ignore[attr-defined]
    params: list[Param] = []
    positional = arguments.posonlyargs + arguments.args
    defaults = [MISSING] * (len(positional) - len(arguments.defaults)) + arguments.defaults
    for index, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "positional" if index < len(arguments.posonlyargs) else "either"
        params.append(Param(arg.arg, kind, default if default is MISSING else _source(default)))
    if arguments.vararg:
        params.append(Param(arguments.vararg.arg, "*args", MISSING))
    for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults):
        params.append(Param(arg.arg, "keyword", MISSING if default is None else _source(default)))
    if arguments.kwarg:
        params.append(Param(arguments.kwarg.arg, "**kwargs", MISSING))
    return params


def _source(node: ast.expr) -> str:
    try:
        return repr(ast.literal_eval(node))
    except ValueError:
        return ast.unparse(node)  # a name: the core's FOREVER, DEFAULT_TIMEOUT


def parameters(function: Any) -> list[Param] | None:
    """``function``'s (or a signature's) parameters after ``self``; None if it states none."""
    text = getattr(function, "__text_signature__", None)
    if isinstance(function, inspect.Signature):
        params = _from_signature(function)
    elif text:
        params = _from_text_signature(text)
    else:
        try:
            params = _from_signature(inspect.signature(function))
        except (TypeError, ValueError):
            return None
    return params[1:]


def _same_default(wanted: object, got: object) -> bool:
    if wanted is MISSING:
        return True  # a default the contract does not promise is harmless
    if got is MISSING:
        return False
    # A default the core names (FOREVER) is compared by behaviour in the engine tests.
    return wanted == got or not _is_literal(got)


def _is_literal(source: object) -> bool:
    try:
        ast.literal_eval(str(source))
    except (ValueError, SyntaxError):
        return False
    return True


def mismatches(protocol: type, implementation: type) -> list[str]:
    """How ``implementation`` departs from ``protocol`` (empty: it keeps it)."""
    found: list[str] = []
    for name, declared in members(protocol).items():
        got = inspect.getattr_static(implementation, name, MISSING)
        where = f"{implementation.__module__}.{implementation.__qualname__}.{name}"
        if got is MISSING:
            found.append(f"{where}: missing")
            continue
        if isinstance(declared, property):
            if callable(got) and not inspect.isdatadescriptor(got):
                found.append(f"{where}: a method, the contract has an attribute")
            continue
        if not callable(got):
            found.append(f"{where}: an attribute, the contract has a method")
            continue
        found += _parameter_mismatches(where, declared, got)
    return found


def _parameter_mismatches(where: str, declared: Any, got: Any) -> list[str]:
    wanted = parameters(declared)
    assert wanted is not None, f"the contract's {where} has no signature"
    have = parameters(got)
    if have is None:
        return [f"{where}: no signature to compare (is embedsignature on?)"]
    dunder = where.rsplit(".", 1)[-1].startswith("__")
    if dunder:  # an operator's slot: only how many operands it takes
        if len(have) != len(wanted):
            return [f"{where}: takes {len(have)} operands, the contract {len(wanted)}"]
        return []
    found = []
    for index, param in enumerate(wanted):
        if index >= len(have):
            found.append(f"{where}: no parameter {param.name!r}")
            continue
        other = have[index]
        if (other.name, other.kind) != (param.name, param.kind):
            found.append(f"{where}: parameter {index + 1} is {other.name!r} ({other.kind}), "
                         f"the contract's {param.name!r} ({param.kind})")
        elif not _same_default(param.default, other.default):
            found.append(f"{where}: {param.name}'s default is {other.default}, "
                         f"the contract's {param.default}")
    for extra in have[len(wanted):]:
        if extra.default is MISSING and extra.kind not in ("*args", "**kwargs"):
            found.append(f"{where}: extra parameter {extra.name!r} without a default")
    return found


@pytest.mark.parametrize("class_name", sorted(_contract.IMPLEMENTED_BY))
def test_engine_classes_keep_the_contract(impl: ModuleType, class_name: str) -> None:
    protocol = _contract.IMPLEMENTED_BY[class_name]
    assert mismatches(protocol, getattr(impl, class_name)) == []


def test_engine_module_keeps_the_contract(impl: ModuleType) -> None:
    declared = members(_contract.EngineModule)
    assert set(declared) == {"LockManager", "RWLockManager", "SemaphoreManager", "KeyLock",
                             "AsyncKeyLock", "end_stranded_task"}
    for name, member in declared.items():
        got = getattr(impl, name)
        if isinstance(member, property):
            assert isinstance(got, type), name
        else:
            assert _parameter_mismatches(f"{impl.__name__}.{name}", member,
                                         _as_method(got)) == []


def _as_method(function: Any) -> Any:
    """A module-level function as a method of the module protocol: ``self`` prepended."""
    text = getattr(function, "__text_signature__", None)
    if text:
        return _TextSigned("($self, " + text[1:])
    signature = inspect.signature(function)
    self = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return signature.replace(parameters=[self, *signature.parameters.values()])


class _TextSigned:
    """Stands for a builtin whose ``__text_signature__`` is ``text``."""

    def __init__(self, text: str) -> None:
        self.__text_signature__ = text


@pytest.mark.parametrize("class_name, maker", [("LockManager", _contract.MakesLockManager),
                                                ("RWLockManager", _contract.MakesRWLockManager)])
def test_constructors_keep_the_contract(impl: ModuleType, class_name: str,
                                        maker: type) -> None:
    """The core's constructors state no signature: every keyword the contract names is
    accepted (with the contract's default), and no positional argument is."""
    params = parameters(maker.__call__)
    assert params and all(param.kind == "keyword" for param in params)
    cls = getattr(impl, class_name)
    made = cls(**{param.name: ast.literal_eval(str(param.default)) for param in params})
    assert type(made) is cls
    with pytest.raises(TypeError):
        cls(True)


def test_the_semaphore_constructor_keeps_the_contract(impl: ModuleType) -> None:
    """``limit`` is its one positional parameter (a keyword too); the rest are keywords."""
    params = parameters(_contract.MakesSemaphoreManager.__call__)
    assert [param.kind for param in params] == ["either", "keyword", "keyword"]
    made = impl.SemaphoreManager(limit=2, fair=False, log_waits_after=None)
    assert (made.limit, made.fair, made.log_waits_after) == (2, False, None)
    assert impl.SemaphoreManager(3).limit == 3
    with pytest.raises(TypeError):
        impl.SemaphoreManager(2, True)


# -- the comparison finds what departs from the contract -----------------------------------


class _Departs:
    """A manager that departs from ``LockEngine`` in each way the comparison looks at."""

    def acquire(self, name: Any, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self, key: Any, *, now: bool) -> None:
        pass

    def locked(self, key: Any, blocking: bool = False) -> bool:
        return False

    def owned(self) -> bool:
        return False

    def owner(self, key: Any) -> None:
        pass

    fair = True  # (fine: an attribute)
    stats = 1  # an attribute where the contract has a method

    def acquire_many(self, keys: Any, blocking: bool = False, timeout: float = -1) -> bool:
        return True

    def __len__(self, extra: int) -> int:
        return 0


def test_the_comparison_finds_departures() -> None:
    found = "\n".join(mismatches(_contract.LockEngine, _Departs))
    assert "_Departs.acquire: parameter 1 is 'name' (either), the contract's 'key'" in found
    assert "_Departs.release: extra parameter 'now' without a default" in found
    assert "_Departs.owned: no parameter 'key'" in found
    assert "_Departs.stats: an attribute, the contract has a method" in found
    assert "_Departs.acquire_many: blocking's default is False, the contract's True" in found
    assert "_Departs.__len__: takes 1 operands, the contract 0" in found
    assert "_Departs._task_levels: missing" in found
    assert "_Departs.locked" not in found and "_Departs.owner" not in found
    assert "_Departs.fair" not in found
    # The core's _task_release has a trailing parameter with a default: allowed.
    core_style = _TextSigned("($self, key, mode, owner=None)")
    assert _parameter_mismatches("x", _contract.Engine._task_release, core_style) == []
    assert _parameter_mismatches("x", _contract.Engine._task_release,
                                 _TextSigned("($self, key, owner, mode)")) != []


@pytest.mark.compiled  # a record of the other engine is one of the foreign ones
def test_an_engine_takes_back_only_its_own_records(impl: ModuleType) -> None:
    """A record is opaque to the views: each engine refuses one it did not make (TypeError,
    before anything is taken or given back), as the core's typed parameters do."""
    from lockmgr import _core, _pure

    locks = impl.LockManager()
    other = (_pure if impl is _core else _core).LockManager()._task_record()
    for foreign in (object(), other, None):
        with pytest.raises(TypeError, match="record"):
            locks._task_exit(foreign, "k", 1)
        for items in ([("k", 1)], []):
            with pytest.raises(TypeError, match="record"):
                locks._task_exit_many(foreign, items)
    for foreign in (object(), other):
        with pytest.raises(TypeError, match="record"):
            locks._task_enter("k", 1, -1.0, False, foreign)
        with pytest.raises(TypeError, match="record"):
            locks._task_enter_many([("k", 1)], -1.0, False, foreign)
    assert not locks.locked("k") and len(locks) == 0
