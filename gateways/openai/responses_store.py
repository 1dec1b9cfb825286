"""Where the OpenAI gateway keeps stored responses (`store`, `previous_response_id`,
`GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`).

The gateways hold no state of the model, but the Responses API keeps a conversation on the
server: a response chained with `previous_response_id` is generated after the stored input and
output of the one it names. `ResponseStore` is the interface; a record is plain JSON data, so a
store may keep it anywhere:

  * `MemoryStore` (`--response-store memory`, the default) keeps the most recently used
    `--response-store-max` records in the gateway process: they are lost when it restarts, and
    each gateway of a fleet has its own (a chained request must reach the gateway that stored
    its predecessor).
  * `RedisStore` (`--response-store redis://host:port/db`, or `rediss://` for TLS) keeps them
    in Redis for `--response-store-ttl` seconds, shared by every gateway that names the same
    database (redis-py's asyncio client; the `redis` extra installs it).
  * `NoStore` (`--response-store none`) stores nothing, as if every request said `store: false`.

A store that cannot be reached raises GatewayError UNAVAILABLE (`STORE_UNAVAILABLE`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
import orjson

from gateways.common.status import GatewayError

if TYPE_CHECKING:
    from redis.asyncio import Redis


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """One stored response.

    Attributes:
        response: the `response` object as it was returned.
        input_items: the request's own input items, with ids, as `input_items` lists them.
        context: every item the next response in the chain is generated after: the context of
            the previous response, this request's input, and this response's output (as input
            items).
    """

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    context: list[dict[str, Any]]


class ResponseStore(Protocol):
    """Stored responses by id (`resp_...`)."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None when there is none under that id."""
        ...

    async def put(self, record: StoredResponse) -> None:
        """Store a response under its id (`record.response["id"]`)."""
        ...

    async def delete(self, response_id: str) -> bool:
        """Delete a stored response; False when there was none."""
        ...

    async def check(self) -> None:
        """Raise GatewayError UNAVAILABLE when the store is known to be unreachable (asked
        before a response to be stored is generated, so that none is generated in vain). It
        costs no round trip while the store's last command succeeded."""
        ...

    async def close(self) -> None:
        """Release the store's connections (at the gateway's shutdown)."""
        ...


class MemoryStore:
    """An in-process store of at most `max_items` responses, the least recently used (stored
    or read) dropped first; lost when the process ends.

    Raises:
        ValueError: `max_items` < 1.
    """

    def __init__(self, max_items: int) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        self.max_items = max_items
        self._records: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, response_id: str) -> StoredResponse | None:
        """See ResponseStore.get; a hit becomes the most recently used."""
        record = self._records.get(response_id)
        if record is not None:
            self._records.move_to_end(response_id)
        return record

    async def put(self, record: StoredResponse) -> None:
        """See ResponseStore.put; the least recently used record goes when the store is full."""
        key = record.response["id"]
        self._records[key] = record
        self._records.move_to_end(key)
        while len(self._records) > self.max_items:
            self._records.popitem(last=False)

    async def delete(self, response_id: str) -> bool:
        """See ResponseStore.delete."""
        return self._records.pop(response_id, None) is not None

    async def check(self) -> None:
        """Always reachable."""

    async def close(self) -> None:
        """Nothing to release."""


class NoStore:
    """A store that keeps nothing (`--response-store none`)."""

    async def get(self, response_id: str) -> StoredResponse | None:
        """Always None."""
        return None

    async def put(self, record: StoredResponse) -> None:
        """Keeps nothing."""

    async def delete(self, response_id: str) -> bool:
        """Always False."""
        return False

    async def check(self) -> None:
        """Always reachable."""

    async def close(self) -> None:
        """Nothing to release."""


def store_unavailable(err: Exception) -> GatewayError:
    """The error for a store that cannot be reached or answer (UNAVAILABLE: the client may retry)."""
    return GatewayError(
        grpc.StatusCode.UNAVAILABLE,
        f"The response store cannot be reached: {err}.",
        reason="STORE_UNAVAILABLE",
    )


class RedisStore:
    """Stored responses in Redis, one string key per response (`trellis:response:<id>`, the
    record as JSON), each expiring `ttl_seconds` after it was stored.

    The store remembers whether its last command reached Redis. `check` sends a PING only
    while that is not known (before the first command, and after a failed one), so a healthy
    store costs no round trip per request; a Redis that goes away fails the command that
    meets it first (UNAVAILABLE), and every later `check` until a PING gets through.

    Args:
        url: a redis-py URL (`redis://host:port/db`, `rediss://...`, `unix://...`).
        ttl_seconds: how long a record is kept (>= 1).

    Raises:
        ValueError: `ttl_seconds` < 1, or a URL redis-py does not take.
        ImportError: redis-py is not installed (`pip install trellis[redis]`).
    """

    PREFIX = "trellis:response:"

    def __init__(self, url: str, ttl_seconds: int) -> None:
        if ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1, got {ttl_seconds}")
        try:
            from redis.asyncio import Redis
        except ImportError:
            raise ImportError("a Redis response store needs redis-py: pip install 'trellis[redis]'") from None
        self.ttl_seconds = ttl_seconds
        self._redis: Redis = Redis.from_url(url)
        #: Whether the last command reached Redis.
        self._reached = False

    async def get(self, response_id: str) -> StoredResponse | None:
        """See ResponseStore.get."""
        raw = await self._call(self._redis.get(self.PREFIX + response_id))
        return None if raw is None else StoredResponse(**orjson.loads(raw))

    async def put(self, record: StoredResponse) -> None:
        """See ResponseStore.put."""
        key = self.PREFIX + record.response["id"]
        await self._call(self._redis.set(key, orjson.dumps(asdict(record)), ex=self.ttl_seconds))

    async def delete(self, response_id: str) -> bool:
        """See ResponseStore.delete."""
        return bool(await self._call(self._redis.delete(self.PREFIX + response_id)))

    async def check(self) -> None:
        """See ResponseStore.check: a PING, unless the last command reached Redis."""
        if not self._reached:
            await self._call(self._redis.ping())

    async def close(self) -> None:
        """Close the connection pool."""
        await self._redis.aclose()

    async def _call(self, pending: Any) -> Any:
        from redis.exceptions import RedisError

        try:
            result = await pending
        except (RedisError, OSError) as e:
            self._reached = False
            raise store_unavailable(e) from None
        self._reached = True
        return result


#: `--response-store` values besides a Redis URL.
STORES = ("memory", "none")
#: URL schemes of a Redis store.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def store_kind(value: str) -> str:
    """Check a `--response-store` value: "memory", "none", or a Redis URL.

    Raises:
        ValueError: anything else.
    """
    if value in STORES or value.startswith(REDIS_SCHEMES):
        return value
    raise ValueError(f"must be memory, none or a Redis URL (redis://host:port/db), got {value!r}")


def make_store(kind: str, max_items: int, ttl_seconds: int) -> ResponseStore:
    """The store a `--response-store` value names (`max_items` for the memory store,
    `ttl_seconds` for Redis).

    Raises:
        ValueError: an unknown kind, or a bound < 1.
        ImportError: a Redis URL without redis-py installed.
    """
    store_kind(kind)
    if kind == "memory":
        return MemoryStore(max_items)
    if kind == "none":
        return NoStore()
    return RedisStore(kind, ttl_seconds)
