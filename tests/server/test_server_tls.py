"""TLS: ``--ssl-certfile`` / ``--ssl-keyfile`` (uvicorn's) serve https and wss. A self-signed certificate made with
``openssl`` at test time; a ``wss://`` client that verifies against it talks to the model, one that trusts only
the system's authorities is refused, and a plain ``ws://`` client gets nowhere."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest
import websockets
from serve_client import Client


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(cert.pem, key.pem)``: a self-signed certificate for localhost and 127.0.0.1, valid for a day."""
    openssl = shutil.which("openssl")
    assert openssl is not None, "openssl is needed to make the test certificate (.ci/run installs it)"
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.timeout(300)
async def test_wss_with_a_self_signed_certificate(serve, certificate) -> None:
    cert, key = certificate
    server = serve(ssl_certfile=cert, ssl_keyfile=key)
    assert server.app.state.settings.tls
    trusted = ssl.create_default_context(cafile=str(cert))
    base = f"127.0.0.1:{server.port}"

    health = httpx.get(f"https://{base}/health", verify=trusted)
    assert health.status_code == 200 and health.json()["free_slots"] == 1
    page = httpx.get(f"https://{base}/", verify=trusted)
    assert page.status_code == 200 and "wss:" in page.headers["content-security-policy"]

    async with websockets.connect(f"wss://{base}/ws", ssl=trusted, max_size=None) as ws:
        assert ws.transport.get_extra_info("ssl_object").version() in ("TLSv1.2", "TLSv1.3")
        client = Client(ws)
        ready = await client.start()
        assert ready["type"] == "ready"
        await client.stream([np.zeros(1920, dtype=np.float32)] * 6)
        bye = await client.stop()
    assert bye["stats"]["consumed_frames"] == 6 and len(client.received.audio()) >= 6

    with pytest.raises(ssl.SSLCertVerificationError):  # the system's authorities do not vouch for it
        async with websockets.connect(f"wss://{base}/ws", ssl=ssl.create_default_context()):
            pass
    with pytest.raises((websockets.InvalidMessage, websockets.InvalidHandshake, OSError, EOFError)):
        async with websockets.connect(f"ws://{base}/ws", open_timeout=10):
            pass
    assert server.hub.free_slots() == 1


def test_tls_files_that_cannot_serve_are_bad_settings(certificate, tmp_path) -> None:
    """A certificate file without a certificate, a missing or mismatched key, an encrypted key: each is refused
    when the settings are read (exit status 2), with the flag and the file named, instead of OpenSSL's ``PEM lib``
    at start-up (which cspan serve used to print as ``unknown error 524297``)."""
    from cspan.core.cli import build_parser
    from cspan.core.settings import SettingsError, settings_from_args

    cert, key = certificate
    other_key = tmp_path / "other.pem"
    encrypted = tmp_path / "encrypted.pem"
    openssl = shutil.which("openssl")
    assert openssl is not None
    subprocess.run([openssl, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(other_key)], check=True)
    subprocess.run(
        [openssl, "pkey", "-in", str(key), "-aes256", "-passout", "pass:secret", "-out", str(encrypted)], check=True
    )
    # a key of another type than the certificate's (EC): was "cannot serve TLS (NO_CERTIFICATE_ASSIGNED)"
    rsa_key = tmp_path / "rsa.pem"
    subprocess.run([openssl, "genpkey", "-algorithm", "RSA", "-out", str(rsa_key)], check=True, capture_output=True)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        (["--ssl-certfile", str(garbage)], rf"--ssl-certfile .*: {garbage}: holds no PEM certificate"),
        (["--ssl-certfile", str(key), "--ssl-keyfile", str(key)], "holds no PEM certificate"),
        (["--ssl-certfile", str(cert)], rf"--ssl-keyfile .*: not given, and {cert} holds no private key"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(garbage)], "holds no PEM private key"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(other_key)], "is not the private key of the certificate"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(rsa_key)], "is not the private key of the certificate"),
        (["--ssl-certfile", str(cert), "--ssl-keyfile", str(encrypted)], "the private key is encrypted"),
        (["--ssl-keyfile", str(key)], "needs --ssl-certfile"),
        # a relative path (a settings file's, typically) says where it was looked for
        (["--ssl-certfile", "certs/x.pem"], r"'certs/x.pem' is not a file \(a relative path is read from the working "),
        ([f"--ssl-certfile={tmp_path}/none.pem"], rf"'{tmp_path}/none.pem' is not a file$"),
    ]
    for argv, message in cases:
        with pytest.raises(SettingsError, match=message):
            settings_from_args(build_parser().parse_args(["serve", *argv]))
    settings = settings_from_args(
        build_parser().parse_args(["serve", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)])
    )
    assert settings.tls
