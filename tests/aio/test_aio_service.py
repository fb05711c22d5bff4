"""Issue 14, a real service: an aiohttp server on 127.0.0.1 moving money between accounts,
its request handlers holding both accounts with ``locks.aio.hold_many``, while a thread pool
beside the event loop (``loop.run_in_executor``) runs synchronous transfers on the same
accounts with ``locks.hold_many``. A real client sends the requests over loopback.

Every transfer reads both balances, waits while holding them (a handler awaits
``asyncio.sleep``, a thread sleeps), then writes them back: without mutual exclusion between
tasks and threads, updates would be lost. Checked on both engines: no request fails, no
account ever has two holders at once, the final balances are exactly what the ledger of
completed transfers says (so money is conserved). And what makes per-account keys serve many
times the requests of one global key, counted rather than timed: requests on distinct
accounts are all inside their holds at once with a key per account, one at a time behind a
global key (the requests per second are the benchmark's: benchmarks/test_asyncio.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from conftest import PATIENCE

ACCOUNTS = 40  # transfers collide all the time
INITIAL = 1_000
CLIENTS = 100  # requests in flight at once (one client task each)
FEEDERS = 4  # synchronous transfers in flight at once (pool threads)
#: (handler, thread) holds: a handler holds both accounts across an ``await asyncio.sleep``
#: this long, a pool thread while it sleeps this long: short, so that many transfers, of both
#: kinds, meet on the same accounts within a short test.
HOLDS = (0.002, 0.001)


class Bank:
    """The accounts, and what the test checks about them."""

    def __init__(self, accounts: int) -> None:
        self.accounts = accounts
        self.balances = [INITIAL] * accounts
        self.holder: list[object] = [None] * accounts
        self.overlaps: list[tuple[int, object, object]] = []
        self.ledger: list[tuple[int, int, int, str]] = []
        self.inside = 0  # transfers between their enter and their leave
        self.most_inside = 0  # the most there ever were at once

    def enter(self, src: int, dst: int, who: object) -> tuple[int, int]:
        """Mark both accounts held by ``who`` (noting any other holder found) and read them."""
        for account in (src, dst):
            if self.holder[account] is not None:
                self.overlaps.append((account, self.holder[account], who))
            self.holder[account] = who
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        return self.balances[src], self.balances[dst]

    def leave(self, src: int, dst: int, amount: int, read: tuple[int, int], kind: str) -> None:
        """Write back what was read, moved by ``amount``, and unmark the accounts."""
        self.balances[src], self.balances[dst] = read[0] - amount, read[1] + amount
        self.ledger.append((src, dst, amount, kind))
        self.holder[src] = self.holder[dst] = None
        self.inside -= 1

    def expected(self) -> list[int]:
        balances = [INITIAL] * self.accounts
        for src, dst, amount, _ in list(self.ledger):
            balances[src] -= amount
            balances[dst] += amount
        return balances


def _plan(seed: int, accounts: int, count: int) -> Iterator[tuple[int, int, int]]:
    """``count`` transfers between two distinct random accounts."""
    rng = random.Random(seed)
    for _ in range(count):
        src, dst = rng.sample(range(accounts), 2)
        yield src, dst, rng.randrange(1, 50)


@dataclass
class Run:
    """What one run of the service did."""

    requests: int = 0  # completed requests
    transfers: int = 0  # completed thread transfers
    failures: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def _listening(app: web.Application) -> AsyncIterator[int]:
    """Serves ``app`` on an ephemeral port of 127.0.0.1 (the port) until the block ends."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        await web.SockSite(runner, listening).start()
        yield listening.getsockname()[1]
    finally:
        await runner.cleanup()


async def _serve(locks: Any, bank: Bank, key: Callable[[int], Hashable], requests_each: int,
                 transfers_each: int) -> Run:
    """Start the service, run CLIENTS client tasks of ``requests_each`` requests and FEEDERS
    thread feeders of ``transfers_each`` transfers against it. Returns what was done."""
    run = Run()
    handler_hold, thread_hold = HOLDS

    async def transfer(request: web.Request) -> web.Response:
        body = await request.json()
        src, dst, amount = body["src"], body["dst"], body["amount"]
        async with locks.aio.hold_many([key(src), key(dst)], timeout=PATIENCE):
            read = bank.enter(src, dst, asyncio.current_task())
            await asyncio.sleep(handler_hold)  # the request's I/O, accounts held
            bank.leave(src, dst, amount, read, "request")
        return web.json_response({"ok": True})

    def sync_transfer(src: int, dst: int, amount: int) -> None:
        with locks.hold_many([key(src), key(dst)], timeout=PATIENCE):
            read = bank.enter(src, dst, threading.current_thread())
            time.sleep(thread_hold)  # blocking work, accounts held
            bank.leave(src, dst, amount, read, "thread")

    async def client(session: aiohttp.ClientSession, port: int, seed: int) -> None:
        for src, dst, amount in _plan(seed, bank.accounts, requests_each):
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
            run.requests += 1

    async def feeder(pool: concurrent.futures.Executor, seed: int) -> None:
        loop = asyncio.get_running_loop()
        for src, dst, amount in _plan(seed, bank.accounts, transfers_each):
            try:
                await loop.run_in_executor(pool, sync_transfer, src, dst, amount)
            except Exception as error:  # a LockTimeout, DeadlockError: recorded, checked
                run.failures.append(f"thread transfer: {error!r}")
                continue
            run.transfers += 1

    app = web.Application()
    app.router.add_post("/transfer", transfer)
    async with _listening(app) as port, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CLIENTS)) as session:
        with concurrent.futures.ThreadPoolExecutor(FEEDERS, thread_name_prefix="transfer") as pool:
            await asyncio.gather(*(client(session, port, seed) for seed in range(CLIENTS)),
                                 *(feeder(pool, 10_000 + seed) for seed in range(FEEDERS)))
    return run


def _check(run: Run, bank: Bank, locks: Any) -> None:
    assert run.failures == [], run.failures[:5]
    assert bank.overlaps == [], f"two holders at once: {bank.overlaps[:5]}"
    assert bank.balances == bank.expected(), "an update was lost"
    assert sum(bank.balances) == bank.accounts * INITIAL
    assert len(locks) == 0 and locks.stats().waiting == 0, "something stayed held or queued"


def test_transfers_from_handlers_and_threads_conserve_money(impl) -> None:
    """A fixed load: 100 clients x 8 requests and 4 pool threads x 25 transfers, all on the
    same 40 accounts. Every one completes, each exactly once, nothing is lost."""
    locks, bank = impl.LockManager(), Bank(ACCOUNTS)
    run = asyncio.run(asyncio.wait_for(
        _serve(locks, bank, lambda account: f"account:{account}", 8, 25), PATIENCE * 6))
    _check(run, bank, locks)
    kinds = [kind for *_, kind in bank.ledger]
    assert (kinds.count("request"), kinds.count("thread")) == (CLIENTS * 8, FEEDERS * 25)
    assert run.requests == CLIENTS * 8 and run.transfers == FEEDERS * 25
    assert locks.stats().contended > 0, "no transfer ever waited: the test tested nothing"


async def _send_at_once(locks: Any, bank: Bank, key: Callable[[int], Hashable],
                        inside: Callable[[], Awaitable[None]]) -> None:
    """The service with CLIENTS requests sent at once, request ``i`` moving money from account
    ``2i`` to ``2i + 1`` (no two requests share an account): each handler holds its two keys
    and awaits ``inside()`` there, counted in ``bank.inside``."""

    async def transfer(request: web.Request) -> web.Response:
        body = await request.json()
        src, dst = body["src"], body["dst"]
        async with locks.aio.hold_many([key(src), key(dst)], timeout=PATIENCE):
            read = bank.enter(src, dst, asyncio.current_task())
            await asyncio.wait_for(inside(), PATIENCE)
            bank.leave(src, dst, 1, read, "request")
        return web.json_response({"ok": True})

    async def client(session: aiohttp.ClientSession, port: int, src: int) -> None:
        payload = {"src": src, "dst": src + 1}
        async with session.post(f"http://127.0.0.1:{port}/transfer", json=payload) as response:
            assert response.status == 200, await response.text()

    app = web.Application()
    app.router.add_post("/transfer", transfer)
    async with _listening(app) as port, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=CLIENTS)) as session:
        await asyncio.wait_for(asyncio.gather(
            *(client(session, port, 2 * i) for i in range(CLIENTS))), PATIENCE * 3)


def test_per_account_keys_let_every_request_in_at_once(impl) -> None:
    """With a key per account, requests on distinct accounts never wait for one another:
    each handler, holding its accounts, waits there until every one of the CLIENTS requests
    is inside (it would time out if any were kept out), and no request ever queued."""
    locks, bank = impl.LockManager(), Bank(2 * CLIENTS)

    async def main() -> None:
        everyone_in = asyncio.Event()

        async def inside() -> None:
            if bank.inside == CLIENTS:
                everyone_in.set()
            await everyone_in.wait()

        await _send_at_once(locks, bank, lambda account: f"account:{account}", inside)

    asyncio.run(main())
    assert bank.most_inside == CLIENTS
    assert bank.overlaps == [] and bank.balances == bank.expected()
    assert locks.stats().contended == 0, "a request on accounts of its own waited"
    assert len(locks) == 0


def test_one_global_key_lets_one_request_in_and_queues_the_rest(impl) -> None:
    """Behind one key for the whole bank, the same requests go in one at a time: the first
    one in stays there until every other one is queued behind it, and no two requests are
    ever inside at once."""
    locks, bank = impl.LockManager(), Bank(2 * CLIENTS)

    async def inside() -> None:
        while locks.stats().waiting < CLIENTS - 1 and not bank.ledger:  # the first one in
            await asyncio.sleep(0.001)

    asyncio.run(_send_at_once(locks, bank, lambda account: "bank", inside))
    assert bank.most_inside == 1
    assert bank.overlaps == [] and bank.balances == bank.expected()
    assert len(bank.ledger) == CLIENTS
    assert locks.stats().contended >= CLIENTS - 1, "the requests did not all queue"
    assert len(locks) == 0
