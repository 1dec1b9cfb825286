"""Where the OpenAI gateway keeps stored responses (`store`, `previous_response_id`,
`GET`/`DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`).

The gateways hold no state of the model, but the Responses API keeps a conversation on the
server: a response chained with `previous_response_id` is generated after the stored input and
output of the one it names. `ResponseStore` is the interface; a record is plain JSON data, so a
store may keep it anywhere. `MemoryStore` (`--response-store memory`, the default) keeps the
most recently used `--response-store-max` records in the gateway process: they are lost when
it restarts, and each gateway of a fleet has its own (a chained request must reach the gateway
that stored its predecessor). `--response-store none` stores nothing, as if every request said
`store: false`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol


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


#: `--response-store` choices.
STORES = ("memory", "none")


def make_store(kind: str, max_items: int) -> ResponseStore:
    """The store a `--response-store` value names.

    Raises:
        ValueError: an unknown kind, or `max_items` < 1 for "memory".
    """
    if kind == "memory":
        return MemoryStore(max_items)
    if kind == "none":
        return NoStore()
    raise ValueError(f"--response-store must be one of {', '.join(STORES)}, got {kind!r}")
