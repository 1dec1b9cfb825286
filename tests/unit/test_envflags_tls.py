"""The TLS flags both islands serve with (envflags.tls): every combination refused, with its
message, every one accepted, and the four flags as a parser gets them (defaults, environment,
usage errors). The credentials built from them: tests/integration/test_tls.py."""

from __future__ import annotations

import pytest

from envflags import EnvArgumentParser
from envflags.tls import CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED, add_server_tls_arguments, check_server_tls

NEED_CERT = "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile"
NEED_CA = "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs (the CA that signs client certificates)"


@pytest.mark.parametrize(
    ("certfile", "keyfile", "ca_certs", "cert_reqs", "message"),
    [
        ("c.pem", "k.pem", "ca.pem", 3, "--ssl-cert-reqs must be 0, 1 or 2, got 3"),
        (None, None, None, -1, "--ssl-cert-reqs must be 0, 1 or 2, got -1"),
        (None, None, "ca.pem", 0, NEED_CERT),
        (None, None, None, 1, NEED_CERT),
        ("", "", "ca.pem", 2, NEED_CERT),
        ("c.pem", None, None, 0, "{label} needs both --ssl-certfile and --ssl-keyfile"),
        (None, "k.pem", "ca.pem", 2, "{label} needs both --ssl-certfile and --ssl-keyfile"),
        ("c.pem", "", None, 0, "{label} needs both --ssl-certfile and --ssl-keyfile"),
        ("c.pem", "k.pem", None, 1, NEED_CA),
        ("c.pem", "k.pem", "", 2, NEED_CA),
    ],
)
@pytest.mark.parametrize("label", ["TLS", "HTTPS"])
def test_refused_combinations_name_the_flags(certfile, keyfile, ca_certs, cert_reqs, message, label):
    with pytest.raises(ValueError) as e:
        check_server_tls(certfile, keyfile, ca_certs, cert_reqs, label=label)
    assert str(e.value) == message.format(label=label)


@pytest.mark.parametrize(
    ("certfile", "keyfile", "ca_certs", "cert_reqs", "served"),
    [
        (None, None, None, CERT_NONE, None),
        ("", "", "", CERT_NONE, None),  # variables rendered empty: not given
        ("c.pem", "k.pem", None, CERT_NONE, ("c.pem", "k.pem")),
        ("c.pem", "k.pem", "ca.pem", CERT_NONE, ("c.pem", "k.pem")),
        ("c.pem", "k.pem", "ca.pem", CERT_OPTIONAL, ("c.pem", "k.pem")),
        ("c.pem", "k.pem", "ca.pem", CERT_REQUIRED, ("c.pem", "k.pem")),
    ],
)
def test_accepted_combinations(certfile, keyfile, ca_certs, cert_reqs, served):
    assert check_server_tls(certfile, keyfile, ca_certs, cert_reqs, label="TLS") == served


def _parser(environ: dict[str, str]) -> EnvArgumentParser:
    p = EnvArgumentParser(prog="t", env_prefix="T_", environ=environ)
    add_server_tls_arguments(p, serves="gRPC over TLS", label="TLS")
    return p


def test_the_flags_default_to_plaintext_and_read_the_environment():
    ns = _parser({}).parse_args([])
    assert (ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs, ns.ssl_cert_reqs) == (None, None, None, 0)
    env = {"T_SSL_CERTFILE": "c", "T_SSL_KEYFILE": "k", "T_SSL_CA_CERTS": "ca", "T_SSL_CERT_REQS": "2"}
    ns = _parser(env).parse_args(["--ssl-cert-reqs", "1"])
    assert (ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs, ns.ssl_cert_reqs) == ("c", "k", "ca", 1)


@pytest.mark.parametrize(
    ("environ", "argv", "named"),
    [
        ({}, ["--ssl-cert-reqs", "3"], "--ssl-cert-reqs"),
        ({}, ["--ssl-cert-reqs", "required"], "--ssl-cert-reqs"),
        ({"T_SSL_CERT_REQS": "5"}, [], "T_SSL_CERT_REQS"),
    ],
)
def test_a_cert_reqs_outside_0_1_2_is_a_usage_error(environ, argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        _parser(environ).parse_args(argv)
    assert e.value.code == 2
    assert named in capsys.readouterr().err


def test_the_help_says_what_the_certificate_serves(capsys):
    p = EnvArgumentParser(prog="t", env_prefix="T_", environ={})
    add_server_tls_arguments(p, serves="HTTPS (and WSS)", label="HTTPS")
    with pytest.raises(SystemExit):
        p.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "serve HTTPS (and WSS) with this PEM certificate chain [env T_SSL_CERTFILE]" in out
    assert "the HTTPS certificate's PEM private key" in out
    assert "2 required (mTLS)" in out
