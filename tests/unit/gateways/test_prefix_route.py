"""Prefix-aware routing (`--routing prefix`): the prefix key of each input kind, the adapter key
of a request for a LoRA adapter, the ring, and bounded loads (gateways.common.prefix_route);
the routing flags."""

from __future__ import annotations

import asyncio
import collections
import logging
import random

import grpc
import pytest
from trellis.generate.v1 import generate_pb2 as pb
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.config import load
from gateways.common.core_client import CoreClient
from gateways.common.prefix_route import (
    HashRing,
    adapter_key,
    adapter_tiers,
    load_bound,
    pick,
    prefix_key,
    requested_adapter,
)
from gateways.common.targets import address_target, dns_name, listed_addresses, parse_core_target
from tests.conftest import NO_REUSEPORT

CORES = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]


def chat(*turns: tuple[str, str], tools: tuple[str, ...] = ()) -> spb.GenerateRequest:
    """A chat request of (role, text) messages."""
    req = spb.GenerateRequest()
    for role, text in turns:
        req.messages.messages.add(role=role, content=[pb.ContentPart(text=text)])
    for name in tools:
        req.messages.tools.add(name=name)
    return req


def test_every_turn_of_a_conversation_has_the_key_of_its_opening():
    opening = (("system", "You are terse."), ("user", "Tell me about ships."))
    turn1 = chat(*opening)
    turn3 = chat(
        *opening, ("assistant", "Ships float."), ("user", "Why?"), ("assistant", "Buoyancy."), ("user", "And?")
    )
    assert prefix_key(turn1) == prefix_key(turn3)
    assert prefix_key(chat(("system", "You are terse."), ("user", "Tell me about trains."))) != prefix_key(turn1)
    assert prefix_key(chat(*opening, tools=("search",))) != prefix_key(turn1)  # tools are rendered first
    assert prefix_key(chat(("system", "only a system prompt"))) == prefix_key(chat(("system", "only a system prompt")))


def test_a_prompt_key_is_its_first_characters_and_token_ids_their_first_quarter():
    header = "x" * 300
    assert prefix_key(spb.GenerateRequest(text=header + "one")) == prefix_key(spb.GenerateRequest(text=header + "two"))
    assert prefix_key(spb.GenerateRequest(text="a" + header), chars=1) != prefix_key(spb.GenerateRequest(text="b"))
    ids = list(range(100))
    a = spb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
    b = spb.GenerateRequest(token_ids=pb.TokenIds(ids=[*ids[:64], 7]))
    assert prefix_key(a) == prefix_key(b)  # 256 characters: 64 ids
    assert prefix_key(a, chars=400) != prefix_key(b, chars=400)
    assert prefix_key(spb.GenerateRequest(text="abc")) != prefix_key(
        spb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]))
    )
    assert prefix_key(spb.GenerateRequest()) == b""
    with pytest.raises(ValueError, match="at least 1 character"):
        prefix_key(a, chars=0)


BASE = frozenset({"demo", "demo-alias"})


def test_the_adapter_a_request_names():
    assert requested_adapter(spb.GenerateRequest(adapter="shout", text="hi"), BASE) == "shout"
    # `model` naming something other than the served model names an adapter (vLLM's convention)...
    assert requested_adapter(spb.GenerateRequest(model="shout", text="hi"), BASE) == "shout"
    # ...and `adapter` wins over it, as in the core.
    assert requested_adapter(spb.GenerateRequest(model="python", adapter="shout"), BASE) == "shout"
    for base in (spb.GenerateRequest(model="demo"), spb.GenerateRequest(model="demo-alias"), spb.GenerateRequest()):
        assert requested_adapter(base, BASE) == ""
    # Before the served model's names are known, only `adapter` names an adapter.
    assert requested_adapter(spb.GenerateRequest(model="shout"), None) == ""
    assert requested_adapter(spb.GenerateRequest(adapter="shout"), None) == "shout"


def test_an_adapter_s_key_never_meets_a_prompt_s():
    assert adapter_key("shout") == b"ashout"
    for request in (spb.GenerateRequest(text="ashout"), spb.GenerateRequest(token_ids=pb.TokenIds(ids=[97])), chat()):
        assert prefix_key(request)[:1] != b"a"


def test_adapter_tiers():
    held = [{"a", "b"}, {"c"}, set(), {"d", "e"}]
    assert adapter_tiers("a", held, 2) == [0, 1, 1, 2]
    assert adapter_tiers("d", held, 2) == [2, 1, 1, 0]
    assert adapter_tiers("x", held, 0) == [2, 2, 2, 2]  # slots unknown: none has room


def test_a_request_for_an_adapter_prefers_a_core_that_holds_it_then_one_with_room():
    ring = HashRing(CORES)
    key = adapter_key("shout")
    home, second, third = ring.order(key)
    usable = [True] * 3
    tiers = [2, 2, 2]
    assert pick(ring, key, [0, 0, 0], usable, tiers=tiers) == home  # all alike: the ring decides
    tiers[third] = 1
    assert pick(ring, key, [0, 0, 0], usable, tiers=tiers) == third  # room beats eviction
    tiers[second] = 0
    assert pick(ring, key, [0, 0, 0], usable, tiers=tiers) == second  # holding it beats room
    loads = [0, 0, 0]
    loads[second] = 4  # at the bound ceil(2 * 5 / 3) = 4: full even though it holds it
    assert pick(ring, key, loads, usable, factor=2.0, tiers=tiers) == third
    assert pick(ring, key, [0, 0, 0], usable, avoid=second, tiers=tiers) == third
    with pytest.raises(ValueError, match="2 tiers for 3 ring members"):
        pick(ring, key, [0, 0, 0], usable, tiers=[0, 1])


def simulate(names: list[str], rounds: int, inflight: int, tiered: bool, seed: int = 0) -> float:
    """Requests for `names` drawn at random, `inflight` at a time ending in random order, over
    three cores of two adapter slots routed as a gateway does: the share that finds their
    adapter among their core's two most recently used (the HF engine's residency)."""
    rng = random.Random(seed)
    ring = HashRing(CORES)
    held: list[collections.OrderedDict[str, None]] = [collections.OrderedDict() for _ in CORES]
    loads, running, hits = [0, 0, 0], [], 0
    for _ in range(rounds):
        name = rng.choice(names)
        if len(running) >= inflight:
            loads[running.pop(rng.randrange(len(running)))] -= 1
        tiers = adapter_tiers(name, held, 2) if tiered else None
        i = pick(ring, adapter_key(name), loads, [True] * 3, 2.0, tiers=tiers)
        hits += name in held[i]
        held[i][name] = None
        held[i].move_to_end(name)
        while len(held[i]) > 2:
            held[i].popitem(last=False)
        loads[i] += 1
        running.append(i)
    return hits / rounds


def test_six_adapters_settle_two_per_core_of_two_slots():
    names = [f"ft-{i}" for i in range(6)]
    # The ring alone puts however many adapters the hash gives on each core (this ring: 4, 0, 2).
    assert collections.Counter(next(HashRing(CORES).order(adapter_key(n))) for n in names) != {0: 2, 1: 2, 2: 2}
    assert simulate(names, 2000, 12, tiered=False) < 0.8
    assert simulate(names, 2000, 12, tiered=True) > 0.9


def test_the_ring_spreads_keys_and_moves_only_a_leaving_core_s_keys():
    ring = HashRing(CORES)
    keys = [f"conversation {i}".encode() for i in range(3000)]
    first = {k: next(ring.order(k)) for k in keys}
    shares = collections.Counter(first.values())
    assert all(800 < shares[i] < 1200 for i in range(3)), shares
    assert all(sorted(ring.order(k)) == [0, 1, 2] for k in keys[:50])
    smaller = HashRing(CORES[:2])
    for k in keys:  # a key of a remaining core stays there
        if first[k] != 2:
            assert smaller.members[next(smaller.order(k))] == CORES[first[k]]


def test_bad_rings_are_refused():
    with pytest.raises(ValueError, match="at least one member"):
        HashRing([])
    with pytest.raises(ValueError, match="distinct"):
        HashRing(["a:1", "a:1"])


def test_bounded_loads_keep_a_key_home_until_its_core_is_full_then_spill_along_the_ring():
    ring = HashRing(CORES)
    key = b"a hot few-shot header"
    home, second, _third = ring.order(key)
    loads = [0, 0, 0]
    usable = [True, True, True]
    assert pick(ring, key, loads, usable) == home
    loads[home] = 1  # bound ceil(1.25 * 2 / 3) = 1: full
    assert pick(ring, key, loads, usable) == second
    loads[second] = 1  # bound ceil(1.25 * 3 / 3) = 2: home has room again
    assert pick(ring, key, loads, usable) == home
    placed = [0, 0, 0]  # one hot key, 60 requests in flight: no core above ceil(1.25 * 60 / 3)
    for _ in range(60):
        placed[pick(ring, key, placed, usable)] += 1
    assert max(placed) <= 25 and min(placed) >= 10, placed
    assert placed[home] == max(placed)


def test_many_keys_stay_home_under_an_even_load():
    ring = HashRing(CORES)
    rng = random.Random(0)
    keys = [f"k{i}".encode() for i in range(300)]
    loads = [5, 5, 5]
    stayed = sum(pick(ring, k, loads, [True] * 3) == next(ring.order(k)) for k in rng.sample(keys, 100))
    assert stayed == 100  # bound ceil(1.25 * 16 / 3) = 7 > 5


def test_down_and_avoided_cores_are_passed_over():
    ring = HashRing(CORES)
    key = b"k"
    home, second, _third = ring.order(key)
    usable = [True] * 3
    usable[home] = False
    assert pick(ring, key, [0, 0, 0], usable) == second
    assert pick(ring, key, [0, 0, 0], [True] * 3, avoid=home) == second
    only = [False] * 3
    only[home] = True
    assert pick(ring, key, [0, 0, 0], only, avoid=home) == home  # nothing else to take it
    assert pick(ring, key, [0, 0, 0], [False] * 3) == home  # nothing usable: the key's own core


def test_bad_pick_arguments_are_refused():
    ring = HashRing(CORES)
    with pytest.raises(ValueError, match="ring members"):
        pick(ring, b"k", [0, 0], [True, True])
    with pytest.raises(ValueError, match="at least 1"):
        pick(ring, b"k", [0, 0, 0], [True] * 3, factor=0.9)
    with pytest.raises(ValueError, match="no usable core"):
        load_bound([0, 0, 0], [False] * 3, 1.25)


def test_routing_flags_parse():
    config = load("openai", 8000, lambda p: None, ["--core", "127.0.0.1:1,127.0.0.1:2", "--routing", "prefix"], {})
    assert (config.routing, config.routing_prefix_chars, config.routing_load_factor) == ("prefix", 256, 1.25)
    environ = {"TRELLIS_GATEWAY_ROUTING": "prefix", "TRELLIS_GATEWAY_ROUTING_LOAD_FACTOR": "2"}
    config = load("lmi", 8080, lambda p: None, ["--core", "dns:///cores:50051"], environ)
    assert config.routing == "prefix" and config.routing_load_factor == 2.0
    assert config.routing_adapter_load_factor == 2.0
    config = load("lmi", 8080, lambda p: None, ["--routing-adapter-load-factor", "3"], {})
    assert config.routing_adapter_load_factor == 3.0
    assert load("lmi", 8080, lambda p: None, [], {}).routing == "round_robin"


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--routing", "random"], "invalid choice"),
        (["--routing-prefix-chars", "0"], "--routing-prefix-chars must be >= 1"),
        (["--routing-load-factor", "0.5"], "--routing-load-factor must be >= 1"),
        (["--routing-load-factor", "nan"], "--routing-load-factor must be >= 1"),
        (["--routing-adapter-load-factor", "0.9"], "--routing-adapter-load-factor must be >= 1"),
        (["--routing", "prefix", "--core", "unix:///run/core.sock"], "needs the cores' addresses"),
        (["--routing", "prefix", "--core", "dns:///cores"], "needs host:port"),
    ],
)
def test_bad_routing_flags_are_usage_errors(argv, phrase, capsys):
    with pytest.raises(SystemExit):
        load("lmi", 8080, lambda p: None, argv, {})
    assert phrase in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, listed, dns",
    [
        ("127.0.0.1:1", ["127.0.0.1:1"], None),
        ("127.0.0.1:1,127.0.0.2:1", ["127.0.0.1:1", "127.0.0.2:1"], None),
        ("ipv6:[::1]:1,[::1]:2", ["[::1]:1", "[::1]:2"], None),
        ("dns:///cores.svc:50051", None, ("cores.svc", 50051)),
        ("dns://8.8.8.8/cores.svc:50051", None, ("cores.svc", 50051)),
        ("unix:///run/core.sock", None, None),
    ],
)
def test_the_cores_a_target_names(value, listed, dns):
    target = parse_core_target(value)
    assert listed_addresses(target) == listed and dns_name(target) == dns


def test_one_core_s_channel_target():
    assert address_target("127.0.0.1:5") == "ipv4:127.0.0.1:5"
    assert address_target("[::1]:5") == "ipv6:[::1]:5"
    assert address_target("core:5") == "core:5"


@pytest.mark.parametrize(
    "kwargs, phrase",
    [
        ({"routing": "random"}, "routing must be one of"),
        ({"routing": "prefix", "load_factor": 0.5}, "load factors must be at least 1"),
        ({"routing": "prefix", "adapter_load_factor": 0.5}, "load factors must be at least 1"),
        ({"routing": "prefix", "prefix_chars": 0}, "at least 1 character"),
    ],
)
async def test_bad_core_client_routing_is_refused(kwargs, phrase):
    with pytest.raises(ValueError, match=phrase):
        CoreClient("127.0.0.1:1,127.0.0.1:2", **kwargs)


async def test_a_core_client_routes_by_prefix_only_over_cores_it_can_name():
    with pytest.raises(ValueError, match="needs the cores' addresses"):
        CoreClient("unix:///run/a.sock,/run/b.sock", routing="prefix")
    client = CoreClient("127.0.0.1:1", routing="prefix")  # one core: nothing to route
    assert client.routing == "round_robin"
    await client.close()
    client = CoreClient("127.0.0.1:1,127.0.0.1:2", routing="prefix")
    assert client.routing == "prefix" and [c.address for c in client._cores] == ["127.0.0.1:1", "127.0.0.1:2"]
    await client.close()


async def test_a_dns_name_s_addresses_become_the_ring(caplog):
    client = CoreClient("dns:///localhost:1", routing="prefix", stream_max_age=0.2)
    client.connect()
    for _ in range(100):
        if client._cores:
            break
        await asyncio.sleep(0.05)
    assert "127.0.0.1:1" in [c.address for c in client._cores]
    client.set_cores(["127.0.0.2:1"])  # the name now points elsewhere: the old core's channel closes
    assert [c.address for c in client._cores] == ["127.0.0.2:1"]
    await client.close()
    failing = CoreClient("dns:///no-such-core.invalid:1", routing="prefix")
    with caplog.at_level(logging.WARNING):
        failing.connect()
        for _ in range(200):
            if "looking up no-such-core.invalid" in caplog.text:
                break
            await asyncio.sleep(0.05)
    assert "looking up no-such-core.invalid for prefix routing failed" in caplog.text
    assert failing._cores == []  # nothing known: requests use the balanced pool
    await failing.close()


async def test_sessions_keep_their_ring_hash_stream_and_other_requests_go_by_prefix():
    # Listening gRPC servers: with closed ports the channels' states move to TRANSIENT_FAILURE
    # at a moment of their own, and an unusable core is routed around.
    servers = [grpc.aio.server(options=NO_REUSEPORT) for _ in range(3)]
    ports = [server.add_insecure_port("127.0.0.1:0") for server in servers]
    for server in servers:
        await server.start()
    client = CoreClient(",".join(f"127.0.0.1:{port}" for port in ports), routing="prefix")
    request = chat(("system", "s"), ("user", "about ships"))
    session = client._stream_for("session-7", request=request)
    assert session.core is None and session in client._sessions.values()
    routed = client._stream_for(None, request=request)
    home = client._cores[next(client._ring.order(prefix_key(request)))]
    assert routed.core == home.address and routed in home.streams
    assert client._stream_for(None, request=request).core == home.address  # idle: home again
    await client.close()
    for server in servers:
        await server.stop(None)
