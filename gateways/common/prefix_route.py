"""Prefix-aware routing over several cores (`--routing prefix`): which core a request goes to
so that requests sharing a leading part meet the core whose prefix cache holds it, and requests
for one LoRA adapter meet the cores that hold it resident (pure functions; `core_client` keeps
the cores and their loads).

- The **key** of a request is its leading part, taken from the `GenerateRequest` every schema
  translates to (OpenAI chat, completions, Responses, Anthropic Messages, LMI, TGI, Triton and
  WebSocket prompts alike), so no schema renders anything twice: for a chat, the messages up to
  and including the first user message, with the tools (a system prompt, the tool list and the
  opening question, which every later turn of the conversation resends unchanged); for text,
  its first `chars` characters; for token ids, the first `chars // 4` ids (about as many tokens
  as `chars` characters make). Every turn of a conversation so has one key, while the messages
  before the *last* user turn would change at every turn and move the conversation to another
  core each time.
- A request that names a LoRA adapter (`requested_adapter`: `GenerateRequest.adapter`, or a
  `model` that is not one of the served model's names, vLLM's convention) is keyed by the
  adapter's name alone instead (`adapter_key`), and the walk prefers cores by their adapters
  (`adapter_tiers`): among the cores below the load bound, the first clockwise that holds the
  adapter, else the first that has a free slot, else the first. A core holds `--max-loras`
  adapters; the gateway knows which from what it sent there (the last `max_loras` distinct
  adapters, as the HF engine evicts the least recently used). Six adapters over three cores
  of two slots so settle two per core, each adapter's requests stay on its cores, and a miss
  (a load, or a wait for a slot while every slot runs another adapter) is rare. Its bound's
  `c` is larger (`--routing-adapter-load-factor`, 2): a miss costs more than a prefix miss. A
  prompt's cached blocks belong to the adapter they were computed with
  (core.engine.hf_prefix), so the adapter's cores are also where its prefixes are.
- The **ring** (`HashRing`) places each core at `VNODES` points of a 64-bit circle (consistent
  hashing, Karger et al. 1997, with virtual nodes as in ketama), so a core joining or leaving
  moves only the keys next to its points, and every gateway with the same cores sends a key to
  the same core without talking to the others.
- **Bounded loads** (`pick`, Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with
  Bounded Loads", SODA 2018): a core takes a request only while its requests in flight are
  below `ceil(c * (in flight + 1) / cores)`; otherwise the walk goes on clockwise. One hot
  prefix so fills its core up to `c` times the average and spills to the next cores on the
  ring, the same ones for every gateway, which then cache it too.

The anchors compared: llm-d's approximate prefix-cache scorer (gateway-api-inference-extension,
`pkg/epp/scheduling/framework/plugins/multi/prefix`: block hashes of the prompt's leading
characters, an LRU index of which pod served which blocks, pods scored by the longest match,
mixed with load scorers) and SMG's `cache_aware` policy (sgl-model-gateway
`src/policies/cache_aware.rs`: an approximate radix tree per worker, the best match above a
threshold, shortest queue when the load is unbalanced). Both keep an index of what each
gateway sent where; the ring needs none and agrees across gateways, at the price of matching
only the key, not the longest prefix. For adapters, the Gateway API Inference Extension's
LoRA-affinity scorer reads each pod's `vllm:lora_requests_info` and prefers pods where the
adapter is running or waiting, then pods with room for one more adapter; the tiers do the same
from what this gateway sent, without polling the cores. Several gateways agree where the ring
decides (an adapter's first cores); which adapters a core holds is each gateway's own view.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Collection, Iterator, Sequence

from trellis.generate.v1 import generate_service_pb2 as spb

#: Points of each core on the ring (ketama's 160: the keys split within a few percent).
VNODES = 160

#: `--routing-prefix-chars`' default: the characters of a prompt that make its key (a system
#: prompt or a few-shot header is longer; a 256-character opening tells conversations apart).
DEFAULT_PREFIX_CHARS = 256

#: `--routing-load-factor`' default: the `c` of bounded loads (the paper's 1.25 keeps the
#: busiest core within a quarter of the average while most keys stay on their first core).
DEFAULT_LOAD_FACTOR = 1.25

#: `--routing-adapter-load-factor`' default: the `c` of bounded loads for a request naming a
#: LoRA adapter. A miss costs more than a prefix miss (the adapter's weights are loaded, and
#: when every slot is running another adapter the request waits for one), so a core holding the
#: adapter takes up to twice the average before another core loads it.
DEFAULT_ADAPTER_LOAD_FACTOR = 2.0

#: Bytes that separate the parts of a key (no part's encoding is confused with another's).
_SEP = b"\x1e"


def _hash(data: bytes) -> int:
    """A 64-bit position on the ring (BLAKE2b: stable across processes and Python versions,
    unlike `hash()`)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(request: spb.GenerateRequest, chars: int = DEFAULT_PREFIX_CHARS) -> bytes:
    """The routing key of a request: its leading part (see the module's description).

    Args:
        request: the request as the gateway sends it.
        chars: characters of a text prompt that make its key (`chars // 4` token ids, at least 1).

    Returns:
        Bytes, equal for two requests exactly when their leading parts are equal; empty for a
        request without input.

    Raises:
        ValueError: `chars` below 1.
    """
    if chars < 1:
        raise ValueError(f"prefix key length must be at least 1 character, got {chars}")
    kind = request.WhichOneof("input")
    if kind == "text":
        return b"t" + request.text[:chars].encode("utf-8", "surrogatepass")
    if kind == "token_ids":
        ids = request.token_ids.ids[: max(1, chars // 4)]
        return b"i" + b"".join(i.to_bytes(4, "big", signed=True) for i in ids)
    if kind == "messages":
        parts = [b"m"]
        parts.extend(t.SerializeToString(deterministic=True) for t in request.messages.tools)
        parts.append(_SEP)
        for message in request.messages.messages:
            parts.append(message.SerializeToString(deterministic=True))
            if message.role == "user":
                break
        return _SEP.join(parts)
    return b""


def requested_adapter(request: spb.GenerateRequest, base_names: Collection[str] | None) -> str:
    """The LoRA adapter a request names: `request.adapter` when set, else `request.model` when
    it is set and not one of `base_names` (the core takes such a model name as an adapter's, or
    refuses it: core/pipeline.py `adapter_by_model`); "" for a request of the base model.

    Args:
        request: the request as the gateway sends it.
        base_names: the served model's names (GetModelInfo's `model_name` and
            `model_aliases`); None while unknown, when only `adapter` names an adapter.
    """
    if request.adapter:
        return request.adapter
    if request.HasField("model") and base_names is not None and request.model not in base_names:
        return request.model
    return ""


def adapter_key(name: str) -> bytes:
    """The routing key of a request for adapter `name`: `b"a"` + the name (no `prefix_key`
    starts with `b"a"`, so an adapter and a prompt never share a place on the ring)."""
    return b"a" + name.encode("utf-8", "surrogatepass")


class HashRing:
    """A consistent-hash ring of named members, `VNODES` points each.

    Args:
        members: the members' names (core addresses), in the order `order` reports indices.

    Raises:
        ValueError: no member, or a name given twice.
    """

    def __init__(self, members: Sequence[str]):
        if not members:
            raise ValueError("a hash ring needs at least one member")
        if len(set(members)) != len(members):
            raise ValueError(f"hash ring members must be distinct: {list(members)}")
        self.members = tuple(members)
        points = sorted((_hash(f"{name}#{v}".encode()), i) for i, name in enumerate(members) for v in range(VNODES))
        self._positions = [p for p, _ in points]
        self._owners = [i for _, i in points]

    def order(self, key: bytes) -> Iterator[int]:
        """Every member's index once, clockwise from `key`'s position on the ring."""
        n = len(self.members)
        seen: set[int] = set()
        owners = self._owners
        start = bisect.bisect(self._positions, _hash(key))
        for k in range(len(owners)):
            i = owners[(start + k) % len(owners)]
            if i not in seen:
                seen.add(i)
                yield i
                if len(seen) == n:
                    return


def adapter_tiers(name: str, held: Sequence[Collection[str]], slots: int) -> list[int]:
    """Per core, how well it suits a request for adapter `name` (`pick`'s tiers): 0 when the
    core holds it, 1 when it holds fewer than `slots` adapters (it loads this one without
    evicting another), 2 otherwise.

    Args:
        name: the adapter.
        held: per core, the adapters it holds (this gateway's estimate: the last `slots`
            distinct adapters it sent there, least recently used evicted first, as the HF
            engine evicts).
        slots: adapters a core holds at once (GetModelInfo's `max_loras`).
    """
    return [0 if name in h else 1 if len(h) < slots else 2 for h in held]


def load_bound(loads: Sequence[int], usable: Sequence[bool], factor: float) -> int:
    """The most requests in flight a usable core may hold before it takes one more:
    `ceil(factor * (in flight on usable cores + 1) / usable cores)` (Mirrokni et al. 2018, with
    the new request counted, so that an idle fleet's bound is at least 1).

    Raises:
        ValueError: no usable core, or `factor` below 1.
    """
    if factor < 1:
        raise ValueError(f"the load factor must be at least 1, got {factor}")
    count = sum(usable)
    if count == 0:
        raise ValueError("no usable core")
    total = sum(load for load, ok in zip(loads, usable, strict=True) if ok)
    return math.ceil(factor * (total + 1) / count)


def pick(
    ring: HashRing,
    key: bytes,
    loads: Sequence[int],
    usable: Sequence[bool],
    factor: float = DEFAULT_LOAD_FACTOR,
    avoid: int | None = None,
    tiers: Sequence[int] | None = None,
) -> int:
    """The member a request with `key` goes to: the first usable one clockwise from the key
    whose load is below `load_bound`, skipping `avoid` (a core that just refused the request)
    while another is usable; with `tiers`, the first such one of the lowest tier. When no
    member is usable, the key's own member (the request then fails there, or is retried).

    Args:
        ring: the members.
        key: the request's `adapter_key` or `prefix_key`.
        loads: requests in flight per member (this gateway's view), in `ring.members` order.
        usable: per member, whether it takes requests (connected, serving).
        factor: `c` of bounded loads, at least 1.
        avoid: a member index to pass over when another is usable.
        tiers: per member, a preference (lower first; `adapter_tiers` for a request for an
            adapter); None: all alike.

    Raises:
        ValueError: `loads`, `usable` or `tiers` not one per member, or `factor` below 1.
    """
    n = len(ring.members)
    if len(loads) != n or len(usable) != n or (tiers is not None and len(tiers) != n):
        raise ValueError(
            f"{len(loads)} loads, {len(usable)} usable flags and {n if tiers is None else len(tiers)} tiers "
            f"for {n} ring members"
        )
    allowed = [ok and i != avoid for i, ok in enumerate(usable)]
    if not any(allowed):
        allowed = list(usable)
    order = ring.order(key)
    if not any(allowed):
        return next(order)
    bound = load_bound(loads, allowed, factor)
    first = best = -1
    for i in order:
        if not allowed[i]:
            continue
        if loads[i] < bound:
            if tiers is None or tiers[i] == 0:
                return i
            if best < 0 or tiers[i] < tiers[best]:
                best = i
        elif first < 0:
            first = i
    # `first` is unreachable by the bound's arithmetic (some usable load is at most the average).
    return best if best >= 0 else first
