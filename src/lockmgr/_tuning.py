"""The engines' tuning: shards per table, when a release hands a key off, the main thread's
wait slice."""

from __future__ import annotations


#: Shards per manager of the compiled core when ``LOCKMGR_SHARDS`` is not set: on a
#: free-threaded build threads using keys of different shards never touch the same memory;
#: with a GIL only one thread runs at a time, so one shard saves memory.
FREE_THREADED_SHARDS = 64
MAX_SHARDS = 1024


def shards_per_table(setting: str | None, free_threaded: bool) -> int:
    """The shard count a ``LOCKMGR_SHARDS`` value asks for (a power of two, 1 to 1024)."""
    if setting is None or setting == "":
        return FREE_THREADED_SHARDS if free_threaded else 1
    try:
        count = int(setting)
    except ValueError:
        count = 0
    if not 1 <= count <= MAX_SHARDS or count & (count - 1):
        raise ValueError(
            f"LOCKMGR_SHARDS must be a power of two from 1 to {MAX_SHARDS}, not {setting!r}"
        )
    return count


#: In ``fair=False`` mode a waiter that has queued this long (seconds) is handed the key
#: directly instead of racing newcomers for it (CPython's and parking_lot's rule).
HANDOFF_AFTER = 0.001

#: The main thread waits in slices this long (seconds) so that Python signal handlers run
#: promptly even when the signal was delivered to another thread.
MAIN_THREAD_SLICE = 0.05
