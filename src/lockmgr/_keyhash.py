"""Keys of the backends across processes (PostgreSQL, host) to 64-bit identities: blake2b of
a canonical encoding, keyed with the namespace. One module for both, so that the same key
is the same identity in every process, Python version and host, whichever backend maps it.

A collision (two keys, one identity) can only make the two keys wait for each other: each
backend locks identities, never keys."""

from __future__ import annotations

import decimal
import hashlib
from collections.abc import Hashable


#: How many recent str keys a ``KeyIdents`` remembers (each call hashes its keys more than
#: once); the table is emptied when full, so memory stays bounded.
REMEMBERED_KEYS = 1024


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
        "keys locked across processes are str, bytes, int or tuples of them,"
        f" not {type(key).__name__}"
    )


def _decimal(number: int) -> str:
    """``str(number)``, however many digits: ``sys.set_int_max_str_digits`` limits int to
    str conversions (4,300 digits by default), not Decimal's, and a key must map to one
    identity whatever the process set."""
    try:
        return str(number)
    except ValueError:
        return str(decimal.Decimal(number))


def namespace_salt(namespace: str) -> bytes:
    """The blake2b key of ``namespace``'s identities."""
    return hashlib.blake2b(namespace.encode(), digest_size=32).digest()


def salted_key(key: Hashable, salt: bytes) -> int:
    """The signed 64-bit identity of ``key`` under ``salt``; TypeError for a key that is
    not str, bytes, int or a tuple of them."""
    digest = hashlib.blake2b(_encode(key), digest_size=8, key=salt).digest()
    return int.from_bytes(digest, "big", signed=True)


class KeyIdents:
    """The identities of one namespace's keys, recent str keys remembered."""

    __slots__ = ("_salt", "_remembered")

    def __init__(self, namespace: str) -> None:
        self._salt = namespace_salt(namespace)
        self._remembered: dict[str, int] = {}

    def of(self, key: Hashable) -> int:
        """``key``'s signed 64-bit identity (TypeError as ``salted_key``)."""
        if type(key) is not str:
            return salted_key(key, self._salt)
        ident = self._remembered.get(key)
        if ident is None:
            if len(self._remembered) >= REMEMBERED_KEYS:
                self._remembered.clear()
            ident = self._remembered[key] = salted_key(key, self._salt)
        return ident

    def remembered(self) -> list[str]:
        """The str keys whose identities are remembered (for naming identities)."""
        return list(self._remembered)
