"""API keys on both protocols and TLS on both, with a self-signed certificate made here."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from pathlib import Path

import grpc
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from serving_helpers import ErrorBody, expected_tokens, fake_controller, running_server

from jaxserve.client import AsyncClient, Client, PermissionDeniedError, UnauthenticatedError, UnavailableError
from jaxserve.serving.grpc_service import bearer_ok

pytestmark = pytest.mark.timeout(120)

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_server():
    with running_server(fake_controller(), api_key=KEY) as s:
        yield s


@pytest.mark.parametrize("api_key", [None, "wrong", KEY + "x", "s3cret-ke"])
def test_grpc_refuses_a_missing_or_wrong_key(keyed_server, api_key):
    with Client(keyed_server.grpc_address, api_key=api_key, timeout_s=10) as c:
        with pytest.raises(UnauthenticatedError) as e:
            c.generate(prompt_ids=[5], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(UnauthenticatedError):
            c.model_info()
        assert c.health()  # health stays open for load balancers


def test_grpc_accepts_the_right_key(keyed_server):
    with Client(keyed_server.grpc_address, api_key=KEY, timeout_s=10) as c:
        assert list(c.generate(prompt_ids=[5, 6], max_tokens=3, ignore_eos=True).token_ids) == expected_tokens(
            [5, 6], 3
        )
        with pytest.raises(PermissionDeniedError, match="admin key"):  # deployment internals: never this key
            c.deployment()


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x"])
def test_http_refuses_a_missing_or_wrong_key(keyed_server, header):
    headers = {"authorization": header} if header else {}
    with httpx.Client(base_url=keyed_server.http_url, headers=headers, timeout=10) as http:
        for r in (http.post("/v1/completions", json={"prompt": [5], "max_tokens": 2}), http.get("/v1/models")):
            assert r.status_code == 401
            assert ErrorBody.model_validate(r.json()).error.code == "invalid_api_key"
        assert http.get("/health").status_code == 200


def test_http_accepts_the_right_key(keyed_server):
    with httpx.Client(base_url=keyed_server.http_url, headers={"authorization": f"Bearer {KEY}"}, timeout=10) as http:
        r = http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 3, "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected_tokens([5, 6], 3)


def test_without_a_key_configured_anything_goes():
    with running_server(fake_controller(first_device=2)) as s:
        with Client(s.grpc_address, api_key="whatever") as c:
            assert len(c.generate(prompt_ids=[5], max_tokens=2, ignore_eos=True).token_ids) == 2
        r = httpx.post(f"{s.http_url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=10)
        assert r.status_code == 200


def test_bearer_check():
    assert bearer_ok(None, None) and bearer_ok("anything", None)
    assert bearer_ok(f"Bearer {KEY}", KEY) and bearer_ok(f"bearer {KEY}", KEY)
    assert not bearer_ok(None, KEY) and not bearer_ok(f"Token {KEY}", KEY) and not bearer_ok("Bearer ", KEY)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


def test_tls_on_both_protocols(tmp_path):
    import asyncio

    cert, key = _self_signed(tmp_path)
    with running_server(fake_controller(first_device=4), tls_cert=cert, tls_key=key, api_key=KEY) as s:
        with Client(s.grpc_address, root_certificates=cert, api_key=KEY, timeout_s=10) as c:
            assert list(c.generate(prompt_ids=[5, 6], max_tokens=3, ignore_eos=True).token_ids) == expected_tokens(
                [5, 6], 3
            )

        async def async_call():
            async with AsyncClient(s.grpc_address, root_certificates=cert, api_key=KEY, timeout_s=10) as ac:
                return await ac.generate(prompt_ids=[5, 6], max_tokens=3, ignore_eos=True)

        assert list(asyncio.run(async_call()).token_ids) == expected_tokens([5, 6], 3)
        # A plaintext client cannot talk to the TLS port.
        with Client(s.grpc_address, api_key=KEY, timeout_s=3) as plain, pytest.raises(UnavailableError):
            plain.generate(prompt_ids=[5], max_tokens=2)
        # HTTPS with the same certificate; an unverified client is refused by the handshake.
        assert s.http_url.startswith("https://")
        ctx = ssl.create_default_context(cafile=str(cert))
        r = httpx.post(
            f"{s.http_url}/v1/completions",
            json={"prompt": [5], "max_tokens": 2},
            headers={"authorization": f"Bearer {KEY}"},
            verify=ctx,
            timeout=10,
        )
        assert r.status_code == 200
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{s.http_url}/health", timeout=5)
