"""Issue 14, a real service: an aiohttp server on 127.0.0.1 moving money between accounts,
its request handlers holding both accounts with ``locks.aio.hold_many``, while a thread pool
beside the event loop (``loop.run_in_executor``) runs synchronous transfers on the same
accounts with ``locks.hold_many``. A real client sends the requests over loopback.

Every transfer reads both balances, waits while holding them (a handler awaits
``asyncio.sleep``, a thread sleeps), then writes them back: without mutual exclusion between
tasks and threads, updates would be lost. Checked on both engines: no request fails, no
account ever has two holders at once, the final balances are exactly what the ledger of
completed transfers says (so money is conserved), and per-account locking serves at least
8x the requests per second of the same service behind one global key.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import random
import socket
import threading
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import aiohttp
from aiohttp import web

from conftest import PATIENCE

CROWDED = 40  # accounts in the correctness test: transfers collide all the time
SPREAD = 2_000  # accounts in the throughput test: a request rarely waits for another
INITIAL = 1_000
CLIENTS = 100  # requests in flight at once (one client task each)
FEEDERS = 4  # synchronous transfers in flight at once (pool threads)
#: (handler, thread) holds: a handler holds both accounts across an ``await asyncio.sleep``
#: this long, a pool thread while it sleeps this long. The throughput test's requests hold
#: long, so that the holding dominates each request's cost; the correctness test's are short,
#: so that many transfers, of both kinds, meet on the same accounts within a short test.
THROUGHPUT_HOLDS = (0.050, 0.002)
CORRECTNESS_HOLDS = (0.002, 0.001)


class Bank:
    """The accounts, and what the test checks about them."""

    def __init__(self, accounts: int) -> None:
        self.accounts = accounts
        self.balances = [INITIAL] * accounts
        self.holder: list[object] = [None] * accounts
        self.overlaps: list[tuple[int, object, object]] = []
        self.ledger: list[tuple[int, int, int, str]] = []

    def enter(self, src: int, dst: int, who: object) -> tuple[int, int]:
        """Mark both accounts held by ``who`` (noting any other holder found) and read them."""
        for account in (src, dst):
            if self.holder[account] is not None:
                self.overlaps.append((account, self.holder[account], who))
            self.holder[account] = who
        return self.balances[src], self.balances[dst]

    def leave(self, src: int, dst: int, amount: int, read: tuple[int, int], kind: str) -> None:
        """Write back what was read, moved by ``amount``, and unmark the accounts."""
        self.balances[src], self.balances[dst] = read[0] - amount, read[1] + amount
        self.ledger.append((src, dst, amount, kind))
        self.holder[src] = self.holder[dst] = None

    def expected(self) -> list[int]:
        balances = [INITIAL] * self.accounts
        for src, dst, amount, _ in list(self.ledger):
            balances[src] -= amount
            balances[dst] += amount
        return balances


def _plan(seed: int, accounts: int, count: int | None) -> Iterator[tuple[int, int, int]]:
    """``count`` transfers (None: endless) between two distinct random accounts."""
    rng = random.Random(seed)
    for _ in itertools.repeat(None) if count is None else range(count):
        src, dst = rng.sample(range(accounts), 2)
        yield src, dst, rng.randrange(1, 50)


@dataclass
class Run:
    """What one run of the service did."""

    requests: int = 0  # completed requests (within the window, for a timed run)
    transfers: int = 0  # completed thread transfers (likewise)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the window's length (a timed run), or the whole run's


async def _serve(locks: Any, bank: Bank, key: Callable[[int], Hashable],
                 holds: tuple[float, float], requests_each: int | None,
                 transfers_each: int | None, window: float | None) -> Run:
    """Start the service on an ephemeral port of 127.0.0.1, run CLIENTS client tasks and
    FEEDERS thread feeders against it, and stop them either after a fixed number of
    requests/transfers each (``window`` None) or when ``window`` seconds have passed (what
    completes after that is not counted, but still checked). Returns what was done."""
    run = Run()
    stopping = [False]
    aio = locks.aio
    handler_hold, thread_hold = holds

    async def transfer(request: web.Request) -> web.Response:
        body = await request.json()
        src, dst, amount = body["src"], body["dst"], body["amount"]
        async with aio.hold_many([key(src), key(dst)], timeout=PATIENCE):
            read = bank.enter(src, dst, asyncio.current_task())
            if not stopping[0]:  # (once a timed run's window is over, the rest drains fast)
                await asyncio.sleep(handler_hold)  # the request's I/O, accounts held
            bank.leave(src, dst, amount, read, "request")
        return web.json_response({"ok": True})

    def sync_transfer(src: int, dst: int, amount: int) -> None:
        with locks.hold_many([key(src), key(dst)], timeout=PATIENCE):
            read = bank.enter(src, dst, threading.current_thread())
            if not stopping[0]:
                time.sleep(thread_hold)  # blocking work, accounts held
            bank.leave(src, dst, amount, read, "thread")

    app = web.Application()
    app.router.add_post("/transfer", transfer)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    await web.SockSite(runner, listening).start()
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(FEEDERS, thread_name_prefix="transfer")
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    session = aiohttp.ClientSession(connector=connector)
    go = asyncio.Event()

    async def client(seed: int) -> None:
        await go.wait()
        for src, dst, amount in _plan(seed, bank.accounts, requests_each):
            if stopping[0]:
                return
            payload = {"src": src, "dst": dst, "amount": amount}
            try:
                async with session.post(f"http://127.0.0.1:{port}/transfer", json=payload) as response:
                    text = await response.text()
                    if response.status != 200:
                        run.failures.append(f"{response.status}: {text[:300]}")
                        continue
            except aiohttp.ClientError as error:
                run.failures.append(repr(error))
                continue
            if not stopping[0]:
                run.requests += 1

    async def feeder(seed: int) -> None:
        await go.wait()
        for src, dst, amount in _plan(seed, bank.accounts, transfers_each):
            if stopping[0]:
                return
            try:
                await loop.run_in_executor(pool, sync_transfer, src, dst, amount)
            except Exception as error:  # a LockTimeout, DeadlockError: recorded, checked
                run.failures.append(f"thread transfer: {error!r}")
                continue
            if not stopping[0]:
                run.transfers += 1

    try:
        workers = [asyncio.ensure_future(client(seed)) for seed in range(CLIENTS)]
        workers += [asyncio.ensure_future(feeder(10_000 + seed)) for seed in range(FEEDERS)]
        await asyncio.sleep(0)  # every worker waits for ``go``
        began = time.perf_counter()
        go.set()
        if window is not None:
            await asyncio.sleep(window)  # the measurement window (what it lasts, not a sync)
            stopping[0] = True
        run.seconds = time.perf_counter() - began if window is not None else 0.0
        await asyncio.gather(*workers)
        if window is None:
            run.seconds = time.perf_counter() - began
    finally:
        await session.close()
        await runner.cleanup()
        pool.shutdown(wait=True)
    return run


def _run_service(impl: ModuleType, accounts: int, key: Callable[[int], Hashable],
                 holds: tuple[float, float], *,
                 requests_each: int | None = None, transfers_each: int | None = None,
                 window: float | None = None) -> tuple[Run, Bank, Any]:
    locks = impl.LockManager()
    bank = Bank(accounts)

    async def main() -> Run:
        return await asyncio.wait_for(
            _serve(locks, bank, key, holds, requests_each, transfers_each, window), PATIENCE * 6)

    run = asyncio.run(main())
    return run, bank, locks


def _check(run: Run, bank: Bank, locks: Any) -> None:
    assert run.failures == [], run.failures[:5]
    assert bank.overlaps == [], f"two holders at once: {bank.overlaps[:5]}"
    assert bank.balances == bank.expected(), "an update was lost"
    assert sum(bank.balances) == bank.accounts * INITIAL
    assert len(locks) == 0 and locks.stats().waiting == 0, "something stayed held or queued"


def test_transfers_from_handlers_and_threads_conserve_money(impl) -> None:
    """A fixed load: 100 clients x 8 requests and 4 pool threads x 25 transfers, all on the
    same 40 accounts. Every one completes, each exactly once, nothing is lost."""
    run, bank, locks = _run_service(impl, CROWDED, lambda account: f"account:{account}",
                                    CORRECTNESS_HOLDS, requests_each=8, transfers_each=25)
    _check(run, bank, locks)
    kinds = [kind for *_, kind in bank.ledger]
    assert (kinds.count("request"), kinds.count("thread")) == (CLIENTS * 8, FEEDERS * 25)
    assert run.requests == CLIENTS * 8 and run.transfers == FEEDERS * 25
    assert locks.stats().contended > 0, "no transfer ever waited: the test tested nothing"


WINDOW = 1.5  # seconds each service is measured for


def test_per_account_locks_serve_8x_one_global_lock(impl) -> None:
    """The same service, the same load, measured for WINDOW seconds each: with one key per
    account, then with one key for the whole bank. A request holds its accounts for 50 ms,
    so the global key allows at most 20 requests/s (less, with the threads' transfers
    queued among them); per-account keys let the 100 clients' requests overlap."""
    per_account, bank, locks = _run_service(impl, SPREAD, lambda account: f"account:{account}",
                                            THROUGHPUT_HOLDS, window=WINDOW)
    _check(per_account, bank, locks)
    global_key, bank, locks = _run_service(impl, SPREAD, lambda account: "bank",
                                           THROUGHPUT_HOLDS, window=WINDOW)
    _check(global_key, bank, locks)
    fast = per_account.requests / per_account.seconds
    slow = global_key.requests / global_key.seconds
    assert slow <= 1 / THROUGHPUT_HOLDS[0] * 1.05, f"the global key let requests overlap: {slow:.0f}/s"
    assert per_account.transfers > 0 and global_key.transfers > 0
    assert fast >= 8 * slow, (
        f"per-account {fast:.0f} requests/s is {fast / slow:.1f}x one global key's {slow:.0f}/s")
