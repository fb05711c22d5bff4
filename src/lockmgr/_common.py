"""The names the compiled core (``lockmgr_core.pyx``) imports from ``lockmgr._common``, where
they lived before it was split by concern: ``_errors`` (the errors and their messages),
``_args`` (argument rules), ``_owners`` (asyncio tasks as owners, the Waker), ``_views`` (the
stats record, reprs, ``synchronized``) and ``_tuning`` (shards, hand-off, slices). Python code
imports those modules; this one stays until the core imports them too."""

from __future__ import annotations

from ._args import (
    Stripe,
    hold_seconds,
    many_items,
    restored_count,
    rw_items,
    stripe_count,
    wait_seconds,
)
from ._errors import (
    block_in_use,
    count_overflow,
    deadlock,
    nested_wait,
    not_entered,
    not_owned,
    pinned,
    timed_out,
    warn_abandoned,
)
from ._owners import AWAIT_POST, LOOP_THREAD, Waker, not_in_task
from ._tuning import HANDOFF_AFTER, MAIN_THREAD_SLICE, shards_per_table
from ._views import PICKLE_ERROR, LockStats, key_lock_repr, manager_repr, synchronized

__all__ = [
    "AWAIT_POST",
    "HANDOFF_AFTER",
    "LOOP_THREAD",
    "MAIN_THREAD_SLICE",
    "PICKLE_ERROR",
    "LockStats",
    "Stripe",
    "Waker",
    "block_in_use",
    "count_overflow",
    "deadlock",
    "hold_seconds",
    "key_lock_repr",
    "manager_repr",
    "many_items",
    "nested_wait",
    "not_entered",
    "not_in_task",
    "not_owned",
    "pinned",
    "restored_count",
    "rw_items",
    "shards_per_table",
    "stripe_count",
    "synchronized",
    "timed_out",
    "wait_seconds",
    "warn_abandoned",
]
