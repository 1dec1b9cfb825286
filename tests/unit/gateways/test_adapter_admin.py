"""gateways.common.adapter_admin: the outcomes of management calls over several cores that the
loopback tests (tests/integration/test_fleet_lora_admin.py) cannot provoke: an undo that
fails, a core refusing ListAdapters, ALREADY_EXISTS beside unreachable cores."""

from __future__ import annotations

import grpc
import pytest
from trellis.generate.v1 import generate_service_pb2 as spb

from gateways.common.adapter_admin import CoreReply, combined, load_verdict, merged_listing, undo_failed, unload_error
from gateways.common.status import GatewayError

DOWN = GatewayError(grpc.StatusCode.UNAVAILABLE, "The model server cannot be reached.")
TAKEN = GatewayError(grpc.StatusCode.ALREADY_EXISTS, "An adapter named 'x' is loaded already; unload it first.")
LOADED = spb.LoadAdapterResponse(adapter=spb.AdapterInfo(name="x", path="/x"))


def test_an_undo_that_fails_names_the_cores_still_serving_the_adapter():
    refusal = GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "The load was refused.", param="path")
    gone = GatewayError(grpc.StatusCode.NOT_FOUND, "not there")
    error = undo_failed(refusal, [CoreReply("a:1", error=DOWN), CoreReply("b:1", error=gone), CoreReply("c:1")])
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT and error.param == "path"
    assert error.message == (
        "The load was refused. Unloading it again failed on a:1: UNAVAILABLE: The model server cannot be "
        "reached.; those cores still serve it."
    )
    assert undo_failed(refusal, [CoreReply("b:1", error=gone), CoreReply("c:1")]) is refusal


def test_a_core_refusing_to_list_fails_the_listing_and_no_core_reached_is_unavailable():
    unimplemented = GatewayError(grpc.StatusCode.UNIMPLEMENTED, "no ListAdapters")
    listing = spb.ListAdaptersResponse(adapters=[spb.AdapterInfo(name="x")], max_loras=2)
    with pytest.raises(GatewayError) as refused:
        merged_listing([CoreReply("a:1", value=listing), CoreReply("b:1", error=unimplemented)])
    assert refused.value is unimplemented
    with pytest.raises(GatewayError) as down:
        merged_listing([CoreReply("a:1", error=DOWN), CoreReply("b:1", error=DOWN)])
    assert down.value is DOWN
    assert merged_listing([CoreReply("a:1", error=DOWN), CoreReply("b:1", value=listing)]) is listing


def test_listings_merge_by_name():
    one = spb.ListAdaptersResponse(
        adapters=[spb.AdapterInfo(name="x", path="/x", rank=8, resident=False, running=1, waiting=2)], max_loras=2
    )
    two = spb.ListAdaptersResponse(
        adapters=[
            spb.AdapterInfo(name="w", path="/w"),
            spb.AdapterInfo(name="x", path="/x", rank=8, resident=True, running=3, waiting=0),
        ],
        max_loras=4,
    )
    merged = merged_listing([CoreReply("a:1", value=one), CoreReply("b:1", value=two)])
    assert [a.name for a in merged.adapters] == ["w", "x"] and merged.max_loras == 4
    x = merged.adapters[1]
    assert (x.resident, x.running, x.waiting, x.path, x.rank) == (True, 4, 2, "/x", 8)


def test_load_verdicts():
    ok = [CoreReply("a:1", value=LOADED), CoreReply("b:1", value=LOADED)]
    assert load_verdict("x", ok, frozenset()) == load_verdict("x", ok, frozenset())
    assert load_verdict("x", ok, frozenset()).reply is LOADED
    # A core already holding it from the same path counts as loaded; one down is left out.
    mixed = [CoreReply("a:1", value=LOADED), CoreReply("b:1", error=TAKEN), CoreReply("c:1", error=DOWN)]
    assert load_verdict("x", mixed, frozenset({"b:1"})).error is None
    # From another path: a conflict, undone on a:1; the unreachable core is named.
    verdict = load_verdict("x", mixed, frozenset())
    assert verdict.undo == ("a:1",) and verdict.error is not None
    assert verdict.error.code is grpc.StatusCode.ALREADY_EXISTS
    assert verdict.error.message == (
        "The adapter 'x' was not loaded on every core: b:1 refused it (ALREADY_EXISTS: An adapter named 'x' is "
        "loaded already; unload it first.); c:1 could not be reached. It was unloaded again from a:1, which had "
        "loaded it."
    )
    # Holding it already beside unreachable cores, none loading it now: ALREADY_EXISTS, named.
    taken = load_verdict("x", [CoreReply("a:1", error=TAKEN), CoreReply("b:1", error=DOWN)], frozenset())
    assert taken.error is not None and taken.error.code is grpc.StatusCode.ALREADY_EXISTS and not taken.undo


def test_unload_verdicts():
    missing = GatewayError(grpc.StatusCode.NOT_FOUND, "The adapter 'x' is not loaded on this server.")
    assert unload_error("x", [CoreReply("a:1"), CoreReply("b:1", error=missing), CoreReply("c:1", error=DOWN)]) is None
    assert unload_error("x", [CoreReply("a:1", error=missing), CoreReply("b:1", error=missing)]) is missing
    partly = unload_error("x", [CoreReply("a:1", error=missing), CoreReply("b:1", error=DOWN)])
    assert partly is not None and partly.code is grpc.StatusCode.NOT_FOUND
    assert partly.message == (
        f"The adapter 'x' was not unloaded: a:1 refused it (NOT_FOUND: {missing.message}); b:1 could not be reached."
    )


def test_combined_needs_a_failure():
    with pytest.raises(ValueError):
        combined("Nothing", [CoreReply("a:1")], [], 1)
