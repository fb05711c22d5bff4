"""Keys to advisory keys: blake2b of a canonical encoding, keyed with the namespace."""

from __future__ import annotations

import decimal
import hashlib
from collections.abc import Hashable


_REMEMBERED_KEYS = 1024


def _encode(key: object) -> bytes:
    """A canonical, type-tagged encoding: equal keys (1 == True) encode alike."""
    if isinstance(key, int):
        return b"i" + _decimal(int(key)).encode()
    if isinstance(key, str):
        return b"s" + key.encode("utf-8", "surrogatepass")
    if isinstance(key, bytes):
        return b"b" + key
    if isinstance(key, tuple):
        parts = [_encode(part) for part in key]
        return b"t" + b"".join(len(part).to_bytes(4, "big") + part for part in parts)
    raise TypeError(
        f"PostgreSQL lock keys are str, bytes, int or tuples of them, not {type(key).__name__}"
    )


def _decimal(number: int) -> str:
    """``str(number)``, however many digits: ``sys.set_int_max_str_digits`` limits int to
    str conversions (4,300 digits by default), not Decimal's, and a key must map to one
    advisory key whatever the process set."""
    try:
        return str(number)
    except ValueError:
        return str(decimal.Decimal(number))


def advisory_key(key: Hashable, namespace: str = "") -> int:
    """The signed 64-bit PostgreSQL advisory key of ``key`` in ``namespace``: what a
    manager of that namespace locks for ``key`` (for ``pg_locks``, or SQL of your own).

    Raises TypeError for a key PostgreSQL cannot take (keys are str, bytes, int and tuples
    of them)."""
    return _salted_key(key, _salt(namespace))


def _salt(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=32).digest()


def _salted_key(key: Hashable, salt: bytes) -> int:
    digest = hashlib.blake2b(_encode(key), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "big", signed=True)
