"""Keys to advisory keys: the identities of ``lockmgr._keyhash``, shared with ``lockmgr.host``."""

from __future__ import annotations

from collections.abc import Hashable

from .._keyhash import namespace_salt, salted_key


def advisory_key(key: Hashable, namespace: str = "") -> int:
    """The signed 64-bit PostgreSQL advisory key of ``key`` in ``namespace``: what a
    manager of that namespace locks for ``key`` (for ``pg_locks``, or SQL of your own).

    Raises TypeError for a key PostgreSQL cannot take (keys are str, bytes, int and tuples
    of them)."""
    return salted_key(key, namespace_salt(namespace))
