#!/usr/bin/env python3
"""Measure the test net: plant one small, realistic bug at a time in an engine, run the suite
against it, and report which bugs the suite caught.

Each mutant is ``(file, original snippet, mutated snippet, description)``. The original must
occur exactly once in the file; a mutant whose snippet is missing (the engine was rewritten)
or ambiguous is reported as such and counts against the run (exit status 1), never skipped
silently. Each mutant runs in its own temporary copy of the tree:

- pure-twin mutants (``src/lockmgr/_pure/*.py``, ``src/lockmgr/_args.py``,
  ``src/lockmgr/_views.py``) run the suite with ``--no-c-extensions`` and ``PYTHONPATH``
  pointing at the copy's ``src`` (fast);
- compiled-core mutants (``lockmgr_core.pyx``, ``src/lockmgr/_c/*.pxi``) are built in place in the copy
  (``setup.py build_ext --inplace``, needs Cython and setuptools>=77 in the running
  interpreter: ``pip install -e '.[test]' 'Cython>=3.0.10,<3.4' 'setuptools>=77'``), then the
  suite runs on the compiled core.

The suite runs as ``python -m pytest -x -q -p no:cacheprovider`` (without the PostgreSQL
backend's, typing and benchmark-CLI tests, which exercise neither engine; core mutants with
``--only-c-extensions``) with a time limit per mutant; a mutant that makes the suite hang past
it counts as caught but is flagged, since a hang is a poor report.

    python scripts/mutants.py                 # every mutant
    python scripts/mutants.py --engine pure   # or: core
    python scripts/mutants.py -k handoff -k soft-edge   # only mutants whose id contains these
    python scripts/mutants.py --list
    python scripts/mutants.py --source /some/other/tree   # measure another checkout's tests

Exit status: 0 if every mutant applied and at least ``--require`` (default 95%) were caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the pure twin, a package on the compiled core's seams
PURE_TABLE = "src/lockmgr/_pure/_table.py"
PURE_OPERATIONS = "src/lockmgr/_pure/_operations.py"
PURE_RUNTIME = "src/lockmgr/_pure/_runtime.py"
PURE_ENGINE = "src/lockmgr/_pure/_engine.py"
ARGS = "src/lockmgr/_args.py"
VIEWS = "src/lockmgr/_views.py"
CORE = "lockmgr_core.pyx"
STATE = "src/lockmgr/_c/state.pxi"
TABLE = "src/lockmgr/_c/table.pxi"
OPERATIONS = "src/lockmgr/_c/operations.pxi"
RUNTIME = "src/lockmgr/_c/runtime.pxi"
ENGINE = "src/lockmgr/_c/engine.pxi"
# the host backend (Python on both engines: its mutants run as the pure twin's)
HOST_KERNEL = "src/lockmgr/host/_kernel.py"
HOST_SHARED = "src/lockmgr/host/_shared.py"
HOST_ENGINE = "src/lockmgr/host/_engine.py"
HOST_WAITS = "src/lockmgr/host/_waits.py"
HOST_HOLDERS = "src/lockmgr/host/_holders.py"
HOST_FENCES = "src/lockmgr/host/_fences.py"


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    original: str
    mutated: str
    description: str

    @property
    def engine(self) -> str:
        return "core" if self.file == CORE or self.file.startswith("src/lockmgr/_c/") else "pure"


def m(id: str, file: str, original: str, mutated: str, description: str) -> Mutant:
    return Mutant(id, file, original, mutated, description)


MUTANTS: list[Mutant] = [
    # -- the host backend -------------------------------------------------------------------
    m("host-try-ignores-waiters", HOST_KERNEL,
      "        if self.others_lock(shard, start + _QUEUE):\n            return False\n", "",
      "a try takes a key other processes wait for (a new reader overtakes a waiting writer)"),
    m("host-readers-ignore-waiting-writers", HOST_KERNEL,
      "if not behind and not (shared and self.others_lock(shard, start + _WRITER)):",
      "if not behind:",
      "a waiting reader does not let a waiting writer of another process in first"),
    m("host-fork-keeps-parent-levels", HOST_ENGINE,
      "        manager._forget_parent_levels()", "        pass",
      "a forked child thinks it holds its parent's keys"),
    m("host-dead-publication-followed", HOST_WAITS,
      "            if slot not in mine and not self._others_lock(0, _LIVE_BASE + slot):\n"
      "                continue",
      "            pass",
      "a wait published by a process that died is still followed"),
    m("host-no-writer-preference-edge", HOST_WAITS,
      "        elif mode == READ and other_wants == wanted and other_mode == WRITE:\n"
      "            found.append(slot)\n", "",
      "the deadlock look misses a reader's wait for a waiting writer"),
    m("host-fence-not-given-back", HOST_ENGINE,
      "            if not done:  # not in time, failed or interrupted: nothing stays",
      "            if not done and not self._fencing:",
      "a fenced acquisition that failed keeps its kernel locks"),
    m("host-fence-counter-only", HOST_FENCES,
      "fence = max(current + 1, time.time_ns() // 1000)", "fence = current + 1",
      "a lost counter file starts fences again from 1"),
    m("host-torn-record-trusted", HOST_HOLDERS,
      "        if not pid or check != _check(ident, pid, started):", "        if not pid:",
      "a writer record torn between two writers is taken for a dead writer"),
    m("host-second-manager-reopens", HOST_SHARED,
      "        if existing is None:\n            opened", "        if True:\n            opened",
      "a second manager of a directory opens (and closing, drops) descriptors of its own"),
    # -- the pure twin ----------------------------------------------------------------------
    m("pure-unfair-never-hands-off", PURE_OPERATIONS,
      "if head.mode == _READ or self._fair or time.monotonic() - head.since >= HANDOFF_AFTER:",
      "if head.mode == _READ or self._fair:",
      "fair=False never hands the key to an aged waiter (only wakes it to race)"),
    m("pure-fair-unfair-swapped", PURE_OPERATIONS,
      "if head.mode == _READ or self._fair or time.monotonic()",
      "if head.mode == _READ or not self._fair or time.monotonic()",
      "fair and unfair hand-off swapped"),
    m("pure-handoff-bound-ignored", PURE_OPERATIONS,
      "time.monotonic() - head.since >= HANDOFF_AFTER",
      "time.monotonic() - head.since >= HANDOFF_AFTER * 1000",
      "unfair hand-off bound a thousand times too long"),
    m("pure-soft-edges-skipped", PURE_OPERATIONS,
      "            if not at_head:\n                for ahead in waits_for.queue:",
      "            if False:\n                for ahead in waits_for.queue:",
      "deadlock search ignores soft edges (requests queued ahead)"),
    m("pure-soft-edge-mode", PURE_OPERATIONS,
      "if mode == _WRITE or ahead.mode == _WRITE:\n                        successors.append",
      "if ahead.mode == _WRITE:\n                        successors.append",
      "soft edges: a write request does not wait for reads queued ahead"),
    m("pure-hard-edge-readers", PURE_OPERATIONS,
      "successors += reversed(waits_for.readers)",
      "pass",
      "deadlock search ignores the readers a writer waits for"),
    m("pure-upgrade-grant-with-other-readers", PURE_OPERATIONS,
      "len(readers) == 1 and request.token in readers)",
      "request.token in readers)",
      "a queued upgrade is granted while other readers still hold"),
    m("pure-set-ignores-queue-on-free-key", PURE_OPERATIONS,
      "                    (not entry.readers and not entry.queue)\n",
      "                    (not entry.readers)\n",
      "a set takes a free key at once although another set waits on it"),
    m("pure-read-set-no-followers", PURE_OPERATIONS,
      "                self._pass_on(node.entry)  # never drops the entry: it has a holder now",
      "                pass",
      "a granted read set does not let in the readers queued behind it on its other keys"),
    m("pure-release-read-no-pass-on", PURE_OPERATIONS,
      "            self._drop_read(entry, token)\n            self._pass_on(entry)\n        return None\n\n    def _release_many",
      "            self._drop_read(entry, token)\n        return None\n\n    def _release_many",
      "release_read of the last read level does not pass the key on"),
    m("pure-release-write-off-by-one", PURE_OPERATIONS,
      "        entry.count -= 1\n        if entry.count == 0:\n            self._disown(entry)\n            self._pass_on(entry)\n        return None",
      "        entry.count -= 1\n        if entry.count <= 1:\n            self._disown(entry)\n            self._pass_on(entry)\n        return None",
      "release frees the key one level early"),
    m("pure-lifo-queue", PURE_OPERATIONS,
      "                else:\n                    node.entry.queue.append(node)",
      "                else:\n                    node.entry.queue.appendleft(node)",
      "requests queue LIFO instead of FIFO"),
    m("pure-contended-not-counted", PURE_OPERATIONS,
      "        self._contended += 1\n        self._record_wait(request, True)",
      "        self._contended += 0\n        self._record_wait(request, True)",
      "stats: contended acquisitions not counted"),
    m("pure-try-lock-timeout-not-counted", PURE_OPERATIONS,
      "        if seconds == 0:\n            self._timeouts += 1\n            return False\n        if token.request is not None:\n            return key, _NESTED",
      "        if seconds == 0:\n            return False\n        if token.request is not None:\n            return key, _NESTED",
      "stats: a failed single-key try-lock is not counted as a timeout"),
    m("pure-deadlocks-not-counted", PURE_OPERATIONS,
      "            self._discard(request)\n            self._deadlocks += 1",
      "            self._discard(request)",
      "stats: refused deadlocks not counted"),
    m("pure-missing-undo-grant", PURE_OPERATIONS,
      "        if request.state == _GRANTED:\n            self._undo_grant(request)\n        else:",
      "        if request.state == _GRANTED:\n            pass\n        else:",
      "a wait interrupted after its grant keeps the key"),
    m("pure-reader-barges-past-writer", PURE_OPERATIONS,
      "if entry.owner is token or (entry.owner is None and not entry.queue):",
      "if entry.owner is token or entry.owner is None:",
      "a new reader gets in past a queued writer"),
    m("pure-one-reader-per-pass", PURE_OPERATIONS,
      "            if head.mode == _WRITE:\n                return\n\n    def _grantable",
      "            return\n\n    def _grantable",
      "only one queued reader granted per release (no batch)"),
    m("pure-release-all-counts-twice", PURE_OPERATIONS,
      "                    if manager is self._ref and token not in entry.readers]",
      "                    if manager is self._ref]",
      "release_all counts a key held for read and write twice"),
    m("pure-thread-exit-no-cleanup", PURE_RUNTIME,
      "        if sys.is_finalizing() or token.request is not None or os.getpid() != _fork_parent_pid:",
      "        if True:",
      "keys of a thread that ends are never released"),
    m("pure-missing-wake", PURE_OPERATIONS,
      "            if was == _WAITING:  # a WOKEN head has its post already\n                head.token.wakeup.release()",
      "            if was == _WAITING and head.mode == _READ:\n                head.token.wakeup.release()",
      "a writer granted (or woken) by release is not woken"),
    m("pure-set-jumps-queue", PURE_OPERATIONS,
      "            or (node.entry.queue[0] is node and self._grantable(node.entry, node))",
      "            or self._grantable(node.entry, node)",
      "a set is granted without being at the head of each of its queues"),
    m("pure-fork-child-not-main", PURE_RUNTIME,
      "    if survivor is not None:\n        survivor.is_main = True",
      "    if survivor is not None:\n        pass",
      "in a child forked from a non-main thread, waits do not wake for signals"),
    m("pure-fork-drops-survivor", PURE_ENGINE,
      "if entry.owner is not None and entry.owner is not survivor:",
      "if entry.owner is not None:",
      "a forked child loses the keys its forking thread held"),
    m("pure-held-miscounted-on-upgrade", PURE_TABLE,
      "        \"\"\"An immediate write acquisition.\"\"\"\n        if entry.queue:  # past a queue (an upgrade, "
      "a barge with fair=False): timed\n            entry.since = time.monotonic()\n        if not entry.readers:",
      "        \"\"\"An immediate write acquisition.\"\"\"\n        if entry.queue:  # past a queue (an upgrade, "
      "a barge with fair=False): timed\n            entry.since = time.monotonic()\n        if True:",
      "stats: held counts a key twice when its reader upgrades"),
    m("pure-leave-waiting-not-decremented", PURE_OPERATIONS,
      "                self._give_back(node)\n        self._waiting -= 1\n        request.state = _LEFT",
      "                self._give_back(node)\n        request.state = _LEFT",
      "stats: a request that times out still counts as waiting"),
    m("pure-release-many-partial", PURE_OPERATIONS,
      "                return index, _NOT_OWNED",
      "                items = items[:index]  # releases the keys before it, silently\n                break",
      "release_many releases the keys before the one not held (not all-or-nothing)"),
    m("pure-set-reentry-count-lost", PURE_OPERATIONS,
      "        if node.mode == _WRITE:\n            entry.count += 1\n        elif token not in entry.readers:",
      "        if node.mode == _WRITE:\n            pass\n        elif token not in entry.readers:",
      "a set re-entering a key it holds does not add a level"),
    m("pure-woken-overtaken-not-requeued", PURE_OPERATIONS,
      "                    request.state = _WAITING  # overtaken: sleep again at the head",
      "                    self._leave(request)  # overtaken: give up\n                    self._timeouts += 1\n                    return False",
      "fair=False: a woken waiter that was overtaken gives up instead of waiting again"),
    m("pure-read-reentry-not-counted", PURE_OPERATIONS,
      "            entry.readers[token] = level + 1",
      "            entry.readers[token] = 1",
      "re-reading a key does not add a read level"),
    m("pure-discard-no-pass-on", PURE_OPERATIONS,
      "        for node in request.members():\n            self._pass_on(node.entry)\n\n    def _undo_grant",
      "        for node in request.members():\n            pass\n\n    def _undo_grant",
      "a request that leaves does not let its entries move on (entries leak, sets block others)"),
    m("pure-sleep-without-slices", PURE_OPERATIONS,
      "            remaining = _WAIT_SLICE\n",
      "            remaining = -1.0 if deadline is None else _WAIT_SLICE\n",
      "a waiter with no timeout sleeps without slices: Ctrl-C waits for the key"),
    m("common-stripe-fold", ARGS,
      "return (mixed ^ (mixed >> 32)) & (count - 1)",
      "return (mixed ^ (mixed >> 31)) & (count - 1)",
      "stripe_index folds at the wrong bit (keys map to other stripes)"),
    m("common-synchronized-drops-kwargs", VIEWS,
      "with manager.hold(key_func(*args, **kwargs)):",
      "with manager.hold(key_func(*args)):",
      "synchronized does not pass keyword arguments to key_func"),
    # -- the compiled core (_c/*.pxi, the noexcept nogil sections) ---------------------------
    m("core-unfair-never-hands-off", TABLE,
      "        if head.mode == READ or table.fair or entry.owner == head.token \\\n                or lockmgr_monotonic() - head.since >= handoff_after:",
      "        if head.mode == READ or table.fair or entry.owner == head.token:",
      "fair=False never hands the key to an aged waiter"),
    m("core-fair-unfair-swapped", TABLE,
      "        if head.mode == READ or table.fair or entry.owner == head.token \\",
      "        if head.mode == READ or not table.fair or entry.owner == head.token \\",
      "fair and unfair hand-off swapped"),
    m("core-soft-edges-skipped", OPERATIONS,
      "    if node.at_head:\n        return False\n    while ahead is not NULL",
      "    if True:\n        return False\n    while ahead is not NULL",
      "deadlock search ignores soft edges"),
    m("core-upgrade-grant-with-other-readers", TABLE,
      "    return request.mode == READ or entry.nreaders == 0 or (\n        entry.nreaders == 1 and entry.readers.token == request.token)",
      "    return request.mode == READ or entry.nreaders == 0 or (\n        read_hold(entry, request.token) is not NULL)",
      "a queued upgrade is granted while other readers still hold"),
    m("core-set-ignores-queue-on-free-key", OPERATIONS,
      "                    (entry.nreaders == 0 and entry.head is NULL)\n",
      "                    (entry.nreaders == 0)\n",
      "a set takes a free key at once although another set waits on it"),
    m("core-read-set-no-followers", TABLE,
      "                    pass_on(table, lead[i].entry, after)  # never drops it: it is held now",
      "                    pass",
      "a granted read set does not let in the readers queued behind it"),
    m("core-release-read-no-pass-on", OPERATIONS,
      "    hold.count -= 1\n    if hold.count == 0:\n        drop_read(entry, hold)\n        pass_on(table, entry, after)\n    return DONE",
      "    hold.count -= 1\n    if hold.count == 0:\n        drop_read(entry, hold)\n    return DONE",
      "release_read of the last level does not pass the key on"),
    m("core-release-write-off-by-one", OPERATIONS,
      "    entry.count -= released[0]\n    if entry.count == 0:",
      "    entry.count -= released[0]\n    if entry.count <= 1:",
      "release frees the key one level early"),
    m("core-lifo-queue", OPERATIONS,
      "    request.at_head = upgrade\n",
      "    request.at_head = True\n",
      "single requests queue LIFO"),
    m("core-contended-not-counted", OPERATIONS,
      "    touched(request.entry).shard.contended += 1\n",
      "    touched(request.entry).shard.contended += 0\n",
      "stats: contended acquisitions not counted"),
    m("core-missing-undo-grant", OPERATIONS,
      "    if request.state == GRANTED:\n        undo_grant(table, request, after)",
      "    if request.state == GRANTED:\n        end_request(table, request, after)",
      "a wait interrupted after its grant keeps the key"),
    m("core-reader-barges-past-writer", OPERATIONS,
      "    if entry.owner == token or (entry.owner is NULL and entry.head is NULL):",
      "    if entry.owner == token or entry.owner is NULL:",
      "a new reader gets in past a queued writer"),
    m("core-hard-edge-readers", OPERATIONS,
      "    if node.mode == WRITE:\n        while hold is not NULL:",
      "    if False:\n        while hold is not NULL:",
      "deadlock search ignores the readers a writer waits for"),
    m("core-stripe-fold", STATE,
      "    return <size_t>(mixed ^ (mixed >> 32))",
      "    return <size_t>(mixed ^ (mixed >> 31))",
      "keys map onto other stripes than the documented function"),
    m("core-missing-wake", TABLE,
      "        if was == WAITING:  # a WOKEN head has its post already\n            wake(head, after)",
      "        if was == WAITING and head.mode == READ:\n            wake(head, after)",
      "a writer granted by release is not woken"),
    m("core-set-jumps-queue", TABLE,
      "    return node.entry.owner == node.token and grantable(node.entry, node) or (\n        node.entry.head == node and grantable(node.entry, node))",
      "    return grantable(node.entry, node)",
      "a set is granted without being at the head of each of its queues"),
    m("core-woken-overtaken-not-requeued", OPERATIONS,
      "            request.state = WAITING  # overtaken: sleep again at the head",
      "            leave(table, request, after)  # overtaken: give up\n            table.timeouts += 1\n            return TIMED_OUT",
      "fair=False: a woken waiter that was overtaken gives up instead of waiting again"),
    m("core-deadlocks-not-counted", OPERATIONS,
      "            request.entry.shard.deadlocks += 1",
      "            pass",
      "stats: refused deadlocks not counted"),
    m("core-try-lock-timeout-not-counted", OPERATIONS,
      "    if try_only:\n        entry.shard.timeouts += 1\n        return BUSY",
      "    if try_only:\n        return BUSY",
      "stats: a failed single-key try-lock is not counted as a timeout"),
    m("core-read-reentry-not-counted", OPERATIONS,
      "            hold.count += 1\n            shard.acquisitions += 1\n            return DONE",
      "            hold.count = 1\n            shard.acquisitions += 1\n            return DONE",
      "re-reading a key does not add a read level"),
    m("core-release-all-counts-twice", OPERATIONS,
      "                if entry.owner != token:\n                    released += keep_key",
      "                if True:\n                    released += keep_key",
      "release_all counts a key held for read and write twice"),
    # (core-fork-child-not-main is gone: the new core sleeps in slices on every thread)
    # -- specific to the section design ---------------------------------------------------
    m("core-end-request-forgets-inflight", OPERATIONS,
      "        touched(request[i].entry).inflight -= 1\n",
      "        touch(request[i].entry.shard)\n",
      "a request that ends leaves its entries marked in use (entries leak)"),
    m("core-queue-forgets-inflight", OPERATIONS,
      "        node.entry.inflight += 1\n        if node.queued:",
      "        if node.queued:",
      "a queued request does not mark its entries in use (an entry is dropped under a waiter)"),
    m("core-release-write-ignores-pinned", OPERATIONS,
      "    if entry.pinned and (fully or entry.count == entry.pinned):\n        return PINNED\n",
      "",
      "release gives up a write level a waiting set pinned"),
    m("core-release-read-ignores-pinned", OPERATIONS,
      "    if hold.count == hold.pinned:\n        return PINNED\n    hold.count -= 1\n    if hold.count == 0:\n        drop_read(entry, hold)\n        pass_on",
      "    hold.count -= 1\n    if hold.count == 0:\n        drop_read(entry, hold)\n        pass_on",
      "release_read gives up a read level a waiting set pinned"),
    m("core-post-owed-never-cleared", OPERATIONS,
      "    if consumed:\n        request.post_owed = False",
      "    if False:\n        request.post_owed = False",
      "a consumed wake-up post is never recorded (the waiter waits for a post forever)"),
    m("core-post-owed-never-set", TABLE,
      "    request.post_owed = True\n",
      "",
      "a scheduled wake-up post is not recorded (a stale post ends a later wait early)"),
    m("core-keep-only-counts-granted", OPERATIONS,
      "        if kept.entry.table == table and (kept.state == WAITING or kept.state == WOKEN):",
      "        if kept.entry.table == table:",
      "a forked child counts a granted kept request as waiting"),
    m("core-thread-exit-no-rounds", RUNTIME,
      "            for rounds in range(EXIT_ROUNDS):\n                if not release_abandoned(token, token.ident):\n                    break",
      "            release_abandoned(token, token.ident)",
      "thread exit does not release what its finalizers took again"),
    m("core-compare-retry-no-spares", ENGINE,
      "                if op.kind == ACQUIRE_WRITE or op.kind == ACQUIRE_READ:\n                    ensure_memory(<void**>&op.token.spare_entry, sizeof(Entry))",
      "                if False:\n                    ensure_memory(<void**>&op.token.spare_entry, sizeof(Entry))",
      "a section retried after __eq__ does not refill the spare entry __eq__ used"),
    m("core-leave-keeps-pinned", OPERATIONS,
      "        else:\n            unpin_and_give_back(request + i)",
      "        else:\n            pass",
      "a set that leaves keeps the levels it pinned"),
    m("core-undo-grant-ignores-pinned", OPERATIONS,
      "            levels = min(node.count, entry.count - entry.pinned)",
      "            levels = node.count",
      "undoing a grant gives back every level it took, also those a handler released"),
    m("core-upgrade-at-once-with-other-readers", OPERATIONS,
      "            or (upgrade and entry.nreaders == 1)):",
      "            or upgrade):",
      "an upgrade is taken at once while other readers still hold"),
    m("core-end-request-no-pass-on", OPERATIONS,
      "        pass_on(table, request[i].entry, after)  # only drops an entry nobody uses now",
      "        pass",
      "a request that ends does not pass its entries on (entries leak, sets block)"),
    m("core-sleep-without-slices", RUNTIME,
      "    cdef double seconds = wait_slice\n",
      "    cdef double seconds = -1.0 if deadline < 0 else wait_slice\n",
      "a waiter with no timeout sleeps without slices"),
    # -- specific to the shards and fast paths ---------------------------------------------
    m("core-fast-acquire-barges-queue", OPERATIONS,
      "    if entry.owner is NULL and entry.nreaders == 0 and entry.head is NULL:\n        own(entry, token, count)",
      "    if entry.owner is NULL and entry.nreaders == 0:\n        own(entry, token, count)",
      "a free key with a queue is taken by a fast path, past its waiters"),
    m("core-fast-release-ignores-queue", OPERATIONS,
      "    if entry.head is not NULL:  # someone to hand the key to\n        return SECTION\n",
      "",
      "a release with waiters frees the key without handing it over or waking anyone"),
    m("core-fast-path-while-waiting", OPERATIONS,
      "    if token.request is not NULL or lockmgr_load_ssize(&token.orphans):\n        return SECTION\n    entry = find_in(shard, lookup, &unsure)\n    if unsure:\n        return SECTION\n    if entry is NULL:",
      "    if lockmgr_load_ssize(&token.orphans):\n        return SECTION\n    entry = find_in(shard, lookup, &unsure)\n    if unsure:\n        return SECTION\n    if entry is NULL:",
      "a waiting thread's own code takes keys by a fast path (its lists race with grants)"),
    m("core-orphans-never-freed", ENGINE,
      "        free_orphans(op.token, &op.after)",
      "        pass",
      "a thread left orphans by freed managers never frees them"),
    m("core-section-forgets-shard", TABLE,
      "    cdef Shard *shard = shard_for(table, lookup.hash)\n    touch(shard)\n    return find_in(shard, lookup, NULL)",
      "    cdef Shard *shard = shard_for(table, lookup.hash)\n    return find_in(shard, lookup, NULL)",
      "a section reads a key's shard without taking its lock"),
]


#: Test files that exercise neither engine's semantics: the PostgreSQL backend, the package's
#: type checking, the benchmark CLI.
UNRELATED = ["postgres", "project/test_typing.py", "bench"]

IGNORE = shutil.ignore_patterns(
    ".git", "__pycache__", "*.so", "*.pyd", "*.c", "*.html", "build", "dist", "*.egg-info",
    ".venv", ".ci-venv*", ".hypothesis", ".pytest_cache", ".mypy_cache", ".benchmarks",
    "wheelhouse",
)


def apply(mutant: Mutant, tree: Path) -> str | None:
    """Plant ``mutant`` in ``tree``; returns why it could not be, or None."""
    path = tree / mutant.file
    text = path.read_text()
    found = text.count(mutant.original)
    if found == 0:
        return "snippet not found"
    if found > 1:
        return f"snippet ambiguous ({found} matches)"
    path.write_text(text.replace(mutant.original, mutant.mutated))
    return None


def last_lines(text: str, count: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return " | ".join(lines[-count:])


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line
    return last_lines(output)


def run_mutant(mutant: Mutant, source: Path, timeout: float, pytest_args: list[str]) -> tuple[str, str]:
    """Returns (outcome, detail): outcome is caught, caught-timeout, missed, not-applied or
    build-failed."""
    with tempfile.TemporaryDirectory(prefix="lockmgr-mutant-") as scratch:
        tree = Path(scratch) / "tree"
        shutil.copytree(source, tree, ignore=IGNORE)
        problem = apply(mutant, tree)
        if problem is not None:
            return "not-applied", problem
        env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1")
        env.pop("LOCKMGR_NO_EXTENSIONS", None)
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   *(f"--deselect=tests/{name}" for name in UNRELATED), *pytest_args]
        if mutant.engine == "core":
            build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                                   cwd=tree, env=env, capture_output=True, text=True,
                                   timeout=timeout)
            if build.returncode != 0:
                return "build-failed", last_lines(build.stdout + build.stderr)
            command.append("--only-c-extensions")  # the twin is not what changed
        else:
            command.append("--no-c-extensions")
        try:
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            return "caught-timeout", f"the suite ran past {timeout:g} s"
        output = done.stdout + done.stderr
        if done.returncode == 0:
            return "missed", last_lines(output, 1)
        if done.returncode in (1, 2) and ("FAILED " in output or "ERROR " in output):
            return "caught", first_failure(output)
        return "caught", f"pytest exit status {done.returncode}: {last_lines(output)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", choices=["pure", "core", "all"], default="all")
    parser.add_argument("-k", dest="only", action="append", default=[],
                        help="run only mutants whose id contains this (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds per mutant (build and suite) before it counts as a hang")
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="the tree to copy (its tests are what is measured)")
    parser.add_argument("--require", type=float, default=0.95,
                        help="fraction of applied mutants that must be caught")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    # A shell starts background jobs with SIGINT ignored, and children inherit that: the
    # suite's Ctrl-C tests would then hang. Python handlers are reset on exec, so this gives
    # every child the default disposition.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    chosen = [mutant for mutant in MUTANTS
              if args.engine in ("all", mutant.engine)
              and (not args.only or any(part in mutant.id for part in args.only))]
    if args.list:
        for mutant in chosen:
            print(f"{mutant.id:45} {mutant.file:24} {mutant.description}")
        return 0
    ids = [mutant.id for mutant in MUTANTS]
    assert len(ids) == len(set(ids)), "mutant ids must be unique"

    results: list[tuple[Mutant, str, str]] = []
    for index, mutant in enumerate(chosen, 1):
        started = time.monotonic()
        outcome, detail = run_mutant(mutant, args.source.resolve(), args.timeout, args.pytest_args)
        results.append((mutant, outcome, detail))
        print(f"[{index}/{len(chosen)}] {outcome.upper():14} {mutant.id} "
              f"({time.monotonic() - started:.0f} s): {detail}", flush=True)

    print()
    failed = False
    for engine in ("pure", "core"):
        mine = [(m, o, d) for m, o, d in results if m.engine == engine]
        if not mine:
            continue
        applied = [(m, o) for m, o, _ in mine if o not in ("not-applied", "build-failed")]
        caught = [m for m, o in applied if o.startswith("caught")]
        hung = [m for m, o in applied if o == "caught-timeout"]
        print(f"{engine}: caught {len(caught)}/{len(applied)}"
              + (f" ({len(hung)} only by hanging past the time limit)" if hung else ""))
        for mutant, outcome, detail in mine:
            if outcome == "missed":
                print(f"  MISSED      {mutant.id}: {mutant.description}")
            elif outcome in ("not-applied", "build-failed"):
                failed = True
                print(f"  {outcome.upper():11} {mutant.id}: {detail}")
        if applied and len(caught) < args.require * len(applied):
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
