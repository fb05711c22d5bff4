"""``snapshot(host=True)``: the keys held or waited for across the processes of the host, as
the registry knows them (``_holders``: writers; ``_waits``: waits published)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .._keyhash import KeyIdents
from ._shared import ProcessDirectory


@dataclass(frozen=True)
class HostKeyState:
    """One identity written or waited for by a process of the host (``snapshot(host=True)``)."""

    key: Hashable | None
    """The key, if this manager knows it (its threads' keys, recent str keys, the ``keys``
    asked about); else None: only ``ident`` names it."""
    ident: int
    """The 64-bit identity (``host_key(key)``)."""
    writer: int | None
    """The pid of the process writing it, if it is recorded (readers are not)."""
    waiting: tuple[int, ...]
    """The pids of the processes whose threads have waited for it for at least 0.25 s
    (``_waits.LOOK_EVERY``: shorter waits are not published), one per waiting thread."""


def host_states(shared: ProcessDirectory, idents: KeyIdents,
                keys: Iterable[Hashable]) -> list[HostKeyState]:
    """Every identity of the directory written or waited for, in identity order. The
    registry knows identities, not namespaces: other namespaces' show too, unnamed."""
    known = {idents.of(key): key for key in [*idents.remembered(), *keys]}
    writers = shared.holders.writers()
    waiting: dict[int, list[int]] = {}
    for wait in shared.waits.live().values():
        waiting.setdefault(wait[4], []).append(wait[1])
    return [HostKeyState(known.get(ident), ident, writers.get(ident),
                         tuple(sorted(waiting.get(ident, ()))))
            for ident in sorted({*writers, *waiting})]
