"""`--core` targets, the service configs grpcio is given, and the gateway's core flags."""

from __future__ import annotations

import json

import grpc
import pytest

from gateways.common.config import load
from gateways.common.targets import (
    HASH_HEADER,
    HEALTH_SERVICE,
    balanced_service_config,
    parse_core_target,
    session_service_config,
)


@pytest.mark.parametrize(
    "value, uri, addresses, several",
    [
        ("127.0.0.1:50051", "127.0.0.1:50051", 1, False),
        ("core:50051", "core:50051", 1, False),
        ("127.0.0.1:1, 127.0.0.1:2,127.0.0.2:3", "ipv4:127.0.0.1:1,127.0.0.1:2,127.0.0.2:3", 3, True),
        ("[::1]:1,[::1]:2", "ipv6:[::1]:1,[::1]:2", 2, True),
        ("dns:///cores.trellis.svc:50051", "dns:///cores.trellis.svc:50051", 1, True),
        ("ipv4:10.0.0.1:1,10.0.0.2:1", "ipv4:10.0.0.1:1,10.0.0.2:1", 2, True),
        ("unix:///run/core.sock", "unix:///run/core.sock", 1, True),
    ],
)
def test_core_values_become_grpc_targets(value, uri, addresses, several):
    target = parse_core_target(value)
    assert (target.uri, target.addresses, target.several) == (uri, addresses, several)


@pytest.mark.parametrize(
    "value, phrase",
    [
        ("", "is empty"),
        ("127.0.0.1", "is not host:port"),
        ("127.0.0.1:1,", "is not host:port"),
        ("127.0.0.1:x", "is not host:port"),
        ("a:1,b:2", "IP addresses only"),
        ("127.0.0.1:1,[::1]:2", "IP addresses only"),
    ],
)
def test_bad_core_values_are_refused_with_a_reason(value, phrase):
    with pytest.raises(ValueError, match=phrase):
        parse_core_target(value)


def test_the_balanced_channel_uses_round_robin_health_checking_and_retries():
    config = json.loads(balanced_service_config())
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": HEALTH_SERVICE}
    policy = config["methodConfig"][0]["retryPolicy"]
    assert policy["retryableStatusCodes"] == ["UNAVAILABLE"] and policy["maxAttempts"] == 3


def test_the_session_channel_hashes_the_session_header_on_a_ring():
    (policy,) = json.loads(session_service_config())["loadBalancingConfig"]
    assert policy == {"ring_hash_experimental": {"requestHashHeader": HASH_HEADER, "minRingSize": 1024}}


async def test_grpcio_accepts_both_service_configs():
    """A channel given a service config it cannot parse fails every call with UNAVAILABLE
    ("Illegal service config"); an accepted one is IDLE and connects on demand."""
    for config in (balanced_service_config(), session_service_config()):
        async with grpc.aio.insecure_channel(
            "ipv4:127.0.0.1:1,127.0.0.1:2", options=[("grpc.service_config", config)]
        ) as channel:
            assert channel.get_state() is grpc.ChannelConnectivity.IDLE


def test_core_flags_parse_with_defaults_and_environment():
    config = load("lmi", 8080, lambda p: None, ["--core", "127.0.0.1:1,127.0.0.1:2", "--core-streams", "6"], {})
    assert config.core_streams == 6 and config.core_retries == 2 and config.core_max_reconnect_backoff_ms == 500
    assert config.name == "lmi"  # the flag checks do not touch the gateway's name
    config = load("lmi", 8080, lambda p: None, [], {"TRELLIS_GATEWAY_CORE_STREAM_MAX_AGE": "2.5"})
    assert config.core_stream_max_age == 2.5 and "core_stream_max_age" not in config.options


@pytest.mark.parametrize(
    "argv, phrase",
    [
        (["--core", "a:1,b:2"], "IP addresses only"),
        (["--core-streams", "-1"], "--core-streams must be >= 0"),
        (["--core-retries", "-2"], "--core-retries must be >= 0"),
        (["--core-reconnect-backoff-ms", "900", "--core-max-reconnect-backoff-ms", "100"], "must be >="),
    ],
)
def test_bad_core_flags_are_usage_errors(argv, phrase, capsys):
    with pytest.raises(SystemExit):
        load("lmi", 8080, lambda p: None, argv, {})
    assert phrase in capsys.readouterr().err
