"""API keys as both islands check them: the core its gRPC callers (core.auth), a gateway its
HTTP clients (gateways.common.auth).

The keys are kept as SHA-256 digests; a presented key is hashed and compared with every digest
using `hmac.compare_digest`, with no early exit, so neither a key's content nor which key
matched shows in the time taken. Standard library only, like the rest of envflags, so both
islands can import it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from typing import Literal

#: Why a presented key was refused: none was sent (or not as "Bearer <key>"), it is unknown, or
#: the request carries more than one credential.
Refusal = Literal["missing", "wrong", "repeated"]

#: What a refusal tells the client, for both islands (each adds how to send a key: a header or
#: gRPC metadata).
REPEATED = "Send one API key: the request carries more than one authorization value."


def split_named(entry: str) -> tuple[str | None, str]:
    """`"name:key"` -> `("name", "key")`; an entry without a colon is an unnamed key.

    A key's name says who holds it: the core and the gateways serve its requests as that tenant
    (docs/fleet.md). Only the first colon separates, so a named key may contain colons; an
    unnamed key must not (give it a name). An empty name or key is refused.

    Raises:
        ValueError: an empty name or key.
    """
    name, sep, key = entry.partition(":")
    if not sep:
        return None, entry
    if not name or not key:
        raise ValueError("an API key must be KEY or NAME:KEY with both non-empty")
    return name, key


class ApiKeys:
    """The accepted keys, kept as SHA-256 digests, with the names of named ones.

    Args:
        keys: the accepted keys, each KEY or NAME:KEY (split_named).

    Raises:
        ValueError: an entry with an empty name or key.
    """

    def __init__(self, keys: Iterable[str]):
        entries = [split_named(k) for k in keys]
        self._digests = [hashlib.sha256(k.encode()).digest() for _, k in entries]
        self._names = [name for name, _ in entries]

    @property
    def named(self) -> bool:
        """Whether any key has a name."""
        return any(n is not None for n in self._names)

    def name_of(self, authorization: str | None) -> str | None:
        """The name of the accepted key that `authorization` ("Bearer <key>") carries; None
        for an unnamed, unknown or missing key. Every digest is compared, as in `check`."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        digest = hashlib.sha256(token.strip().encode()).digest()
        found: str | None = None
        for known, name in zip(self._digests, self._names, strict=True):
            if hmac.compare_digest(known, digest) and found is None:
                found = name
        return found

    def check_all(self, values: Sequence[str]) -> Refusal | None:
        """`check` of a request's every credential value (repeated headers or metadata entries).

        One rule on both islands: more than one value is "repeated", whatever they hold, since
        proxies and frameworks disagree on which of several headers wins (first, last, or
        joined), and a key checked here must be the one the request is served under.
        """
        if len(values) > 1:
            return "repeated"
        return self.check(values[0] if values else None)

    @staticmethod
    def identity(authorization: str | None) -> str:
        """An opaque, stable identity of the key in `authorization` ("Bearer <key>"): the first
        32 hex digits of its SHA-256 digest ("" without a key). It keys what belongs to the
        key's holder (continue-generation sessions) without revealing the key."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ""
        return hashlib.sha256(token.strip().encode()).hexdigest()[:32]

    def check(self, authorization: str | None) -> Refusal | None:
        """None when `authorization` ("Bearer <key>", the scheme in any case, RFC 6750) carries
        an accepted key; else "missing" or "wrong"."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return "missing"
        digest = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for known in self._digests:  # every key, always
            ok |= hmac.compare_digest(known, digest)
        return None if ok else "wrong"
