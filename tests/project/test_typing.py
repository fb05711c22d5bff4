"""The public API type-checks strictly for its users, and a wrong key type is a type error.

(That the package itself is ``mypy --strict`` clean, the twin held to the engine contract
included, is one step of CI of its own: ``make typecheck``.) mypy is part of the [test]
extra: a missing mypy fails here (never a skip), since CI must run these."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import importlib.util


USE = """
from lockmgr import LockManager, KeyLock
locks: LockManager[int] = LockManager()
ok: bool = locks.acquire(1, timeout=0.5)
view: KeyLock[int] = locks[2]
with locks.hold(3, timeout=None):
    pass
"""


def test_mypy_is_installed() -> None:
    assert importlib.util.find_spec("mypy") is not None, "pip install -e '.[test]' (it has mypy)"


def _mypy(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental", *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)


def test_wrong_key_type_is_a_type_error(tmp_path: Path) -> None:
    good = tmp_path / "good.py"
    good.write_text(USE)
    assert _mypy(str(good)).returncode == 0, _mypy(str(good)).stdout
    bad = tmp_path / "bad.py"
    bad.write_text(USE + 'locks.acquire("x")\n')
    done = _mypy(str(bad))
    assert done.returncode == 1 and 'incompatible type "str"' in done.stdout, done.stdout


# -- synchronized keeps the decorated function's signature (issue 14) -----------------------


def _expected_errors(module: str) -> dict[int, str]:
    """``# E: text`` at the end of a line: mypy must report an error containing ``text``
    on that line (1-based); no other line may have one."""
    return {number: line.split("# E: ", 1)[1]
            for number, line in enumerate(module.splitlines(), 1) if "# E: " in line}


def _check_errors(module: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "use.py"
    path.write_text(module)
    done = _mypy(str(path))
    found: dict[int, str] = {}
    for line in done.stdout.splitlines():
        if line.startswith(f"{path}:") and ": error: " in line:
            number = int(line[len(f"{path}:"):].split(":", 1)[0])
            found[number] = found.get(number, "") + line
    expected = _expected_errors(module)
    for number, text in expected.items():
        assert text in found.get(number, ""), f"line {number}: expected {text!r}\n{done.stdout}"
    assert set(found) <= set(expected), f"unexpected errors:\n{done.stdout}"
    return done


def _revealed(done: subprocess.CompletedProcess[str]) -> list[str]:
    """The revealed types, with ``builtins.`` left out (mypy before 2.0 writes it)."""
    return [line.split("Revealed type is ", 1)[1].strip('"').replace("builtins.", "")
            for line in done.stdout.splitlines() if "Revealed type is " in line]


SYNCHRONIZED = """
from lockmgr import LockManager
from lockmgr.postgres import PgLockManager

locks: LockManager[str] = LockManager()
pg: PgLockManager[str] = PgLockManager("postgresql:///none")

@locks.synchronized(lambda natural_id, **_: natural_id)
def create_if_missing(natural_id: str, *, retries: int = 3) -> bool:
    return natural_id != "" and retries > 0

@pg.synchronized(lambda invoice: f"invoice:{invoice}")
def pay(invoice: int) -> str:
    return str(invoice)

created: bool = create_if_missing("id-1", retries=2)
paid: str = pay(881)
reveal_type(create_if_missing)
reveal_type(pay)
create_if_missing(42)  # E: Argument 1 to "create_if_missing" has incompatible type "int"
create_if_missing("id", retries="3")  # E: Argument "retries" to "create_if_missing" has incompatible type "str"
wrong: str = create_if_missing("id")  # E: Incompatible types in assignment (expression has type "bool"
pay()  # E: Missing positional argument "invoice" in call to "pay"

def count(number: int) -> int:
    return number

locks.synchronized(count)  # E: Argument 1 to "synchronized" of "LockManager" has incompatible type
"""


def test_synchronized_keeps_the_signature(tmp_path: Path) -> None:
    """Under --strict: no "Untyped decorator makes function untyped"; the decorated
    function keeps its parameter names, kinds, defaults and result, so bad calls are type
    errors; a key_func whose result is not the manager's key type is one too."""
    done = _check_errors(SYNCHRONIZED, tmp_path)
    assert "Untyped decorator" not in done.stdout, done.stdout
    assert _revealed(done) == [
        "def (natural_id: str, *, retries: int =) -> bool",
        "def (invoice: int) -> str",
    ], done.stdout


AIO_SYNCHRONIZED = """
import asyncio
from lockmgr import AsyncLockManager, AsyncRWLockManager, LockManager, RWLockManager

locks: LockManager[str] = LockManager()
aio: AsyncLockManager[str] = locks.aio
rw: RWLockManager[int] = RWLockManager()
rw_aio: AsyncRWLockManager[int] = rw.aio

@locks.aio.synchronized(lambda account, **_: f"account:{account}")
async def debit(account: str, amount: int, *, note: str = "") -> float:
    return float(amount)

async def main() -> None:
    balance: float = await debit("a", 5, note="rent")
    task: asyncio.Task[float] = asyncio.create_task(debit("b", 1))
    both: list[float] = list(await asyncio.gather(debit("c", 2), task))
    async with aio.hold("a", timeout=1.0):
        pass
    async with aio["a"]:
        pass
    async with aio.hold_many(["a", "b"]):
        pass
    async with rw_aio.read(1), rw_aio.write(2):
        pass
    async with rw_aio.hold_many(reads=[1], writes=[2]):
        pass
    got: bool = await aio.acquire("a", timeout=0.5)
    await debit(1, 5)  # E: Argument 1 to "debit" has incompatible type "int"
    wrong: str = await debit("a", 1)  # E: Incompatible types in assignment (expression has type "float"
    await aio.acquire(42)  # E: Argument 1 to "acquire" of "AsyncLockManager" has incompatible type "int"
    await rw_aio.acquire_read("k")  # E: Argument 1 to "acquire_read" of "AsyncRWLockManager" has incompatible type "str"

reveal_type(debit)

@aio.synchronized(lambda account: account)  # E: has incompatible type
def not_a_coroutine(account: str) -> int:
    return 0
"""


def test_aio_synchronized_keeps_the_signature(tmp_path: Path) -> None:
    """``locks.aio.synchronized`` on a coroutine function keeps its signature and returns a
    coroutine (``asyncio.create_task`` and ``gather`` accept the call); the views are
    generic in the key; a plain function is no coroutine function, a type error too."""
    done = _check_errors(AIO_SYNCHRONIZED, tmp_path)
    assert "Untyped decorator" not in done.stdout, done.stdout
    revealed = _revealed(done)
    assert revealed[0].startswith("def (account: str, amount: int, *, note: str =) -> "), done.stdout
    assert revealed[0].endswith("Coroutine[Any, Any, float]"), done.stdout


SINGLEFLIGHT = """
import asyncio
from lockmgr import Singleflight

flight: Singleflight[str, int] = Singleflight()

def load(user: str, shard: int) -> int:
    return shard

async def fetch(user: str) -> int:
    return len(user)

value: int = flight.call("user:1", load, "user:1", 3)
timed: int = flight.call("user:1", load, "user:1", 3, timeout=0.5)
flight.call(1, load, "user:1", 3)  # E: Argument 1 to "call" of "Singleflight" has incompatible type "int"
flight.call("user:1", load, "user:1", "3")  # E: Argument 2 to "call" of "Singleflight" has incompatible type
flight.call("user:1", load, "user:1", 3, shard=3)  # E: Unexpected keyword argument "shard"
wrong: str = flight.call("user:1", load, "user:1", 3)  # E: Incompatible types in assignment

async def main() -> None:
    fetched: int = await flight.aio.call("user:1", fetch, "user:1", timeout=1.0)
    await flight.aio.call("user:1", fetch, 1)  # E: Argument 2 to "call" of "AsyncSingleflight" has incompatible type

@flight.shared(key=lambda user: user)
def profile(user: str) -> int:
    return len(user)

reveal_type(profile)
profile(3)  # E: Argument 1 to "profile" has incompatible type "int"
"""


def test_singleflight_checks_the_function_s_arguments(tmp_path: Path) -> None:
    """``call`` checks the arguments against the function's parameters and the key and the
    result against the group's types; options are keyword-only, the function's keywords are
    refused (they go through functools.partial); a shared function keeps its signature."""
    done = _check_errors(SINGLEFLIGHT, tmp_path)
    assert _revealed(done) == ["def (user: str) -> int"]


SEMAPHORES = """
import asyncio
from lockmgr import AsyncSemaphoreManager, KeySemaphore, SemaphoreManager

exports: SemaphoreManager[str] = SemaphoreManager(limit=3)
per_plan: SemaphoreManager[str] = SemaphoreManager(lambda tenant: len(tenant))
view: KeySemaphore[str] = exports["tenant"]
aio: AsyncSemaphoreManager[str] = exports.aio

with exports.hold("tenant", timeout=1.0), view, exports.hold_many(["a", "b"]):
    left: int = exports.available("tenant") + view.holders()

@exports.synchronized(lambda tenant: tenant)
def export(tenant: str) -> bytes:
    return b""

async def main() -> None:
    got: bool = await aio.acquire("tenant", timeout=0.5)
    async with aio.hold("tenant"), aio["tenant"]:
        pass
    await aio.acquire(42)  # E: Argument 1 to "acquire" of "AsyncSemaphoreManager" has incompatible type "int"

exports.acquire(42)  # E: Argument 1 to "acquire" of "SemaphoreManager" has incompatible type "int"
export(7)  # E: Argument 1 to "export" has incompatible type "int"
SemaphoreManager(limit="3")  # E: Argument "limit" to "SemaphoreManager" has incompatible type "str"
reveal_type(export)
"""


def test_semaphore_managers_are_generic_in_the_key(tmp_path: Path) -> None:
    """A ``SemaphoreManager[K]``, its views and ``aio`` take keys of type K only; ``limit``
    is an int or a callable; ``synchronized`` keeps the function's signature."""
    done = _check_errors(SEMAPHORES, tmp_path)
    assert "Untyped decorator" not in done.stdout, done.stdout
    assert _revealed(done) == ["def (tenant: str) -> bytes"], done.stdout
