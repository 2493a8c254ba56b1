"""The controller over HTTPS with a self-signed certificate made in the test (the
`cryptography` package): the worker's client and session verify it against a CA file
(`WorkerOptions.tls_verify`, the worker's `--tls_ca_file`) and refuse an untrusted one."""

import datetime
import ipaddress
import time

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.client import ControllerClient
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import LeaseRequest, WorkerProfile
from bridge.tasks import make_task
from rollout_gpu.session import ControllerSession, WorkerOptions

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.5, max_concurrent_sequences=16)


def self_signed(directory, name: str) -> tuple[str, str]:
    """(cert.pem, key.pem) of a self-signed certificate for 127.0.0.1 and localhost: its
    own CA, with the extensions strict X.509 verification (Python >= 3.13) wants."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = str(directory / f"{name}.pem"), str(directory / f"{name}.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return cert_path, key_path


@pytest.fixture
def https_controller(tmp_path, text_codec):
    cert, key = self_signed(tmp_path, "controller")
    ctl = Controller(
        ControllerConfig(groups_per_step=2, group_size=2),
        str(tmp_path / "c.db"),
        make_task("arithmetic"),
        codec=text_codec,
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions(certfile=cert, keyfile=key))
    secret = (tmp_path / "join_token").read_text().strip()
    yield ctl, server, secret, cert
    server.stop()
    ctl.close()


def test_worker_client_verifies_the_controller_against_a_ca_file(https_controller):
    ctl, server, secret, ca_file = https_controller
    assert server.url.startswith("https://127.0.0.1:")
    ctl.publish(0)
    client, reg = ControllerClient.join(server.url, secret, PROFILE, verify=ca_file)
    r = client.lease(LeaseRequest(worker_version=0, max_groups=1))
    assert r.lease is not None and r.lease.groups[0].prompt_token_ids
    assert client.release(r.lease.lease_id).ok
    client.close()
    # What the worker binary runs: a session with --tls_ca_file, heartbeats included.
    session = ControllerSession(
        WorkerOptions(
            controller=server.url, join_secret=secret, profile=PROFILE, tls_verify=ca_file
        )
    )
    session.join()
    session.heartbeat_once()
    assert session.announcement.version == 0
    session.leave()


def test_untrusted_or_plain_connections_are_refused(https_controller, tmp_path):
    ctl, server, secret, _ = https_controller
    other_ca, _ = self_signed(tmp_path, "impostor")
    with pytest.raises(httpx.ConnectError):  # the system CAs do not know a self-signed cert
        ControllerClient.join(server.url, secret, PROFILE)
    with pytest.raises(httpx.ConnectError):  # nor does another CA
        ControllerClient.join(server.url, secret, PROFILE, verify=other_ca)
    with pytest.raises(httpx.HTTPError):  # and plain HTTP is not served
        httpx.get(server.url.replace("https", "http") + "/openapi.json")
    assert ctl.stats()["fleet/active_workers"] == 0


def test_stop_does_not_wait_for_an_idle_worker_connection(https_controller):
    """uvicorn waits for every connection to close, and an idle TLS one closes only when
    the client answers close_notify, which an idle pooled client never reads: a joined
    worker held the controller's stop (the binary's exit) for its full 10 s timeout."""
    ctl, server, secret, ca_file = https_controller
    ctl.publish(0)
    session = ControllerSession(
        WorkerOptions(
            controller=server.url, join_secret=secret, profile=PROFILE, tls_verify=ca_file
        )
    )
    session.join()
    session.heartbeat_once()  # its keep-alive connection stays open, idle
    thread = server._thread
    started = time.monotonic()
    server.stop()  # the grace for requests in flight is 10 s; none is in flight
    assert not thread.is_alive()
    assert time.monotonic() - started < 5.0  # ~0.2 s; the bug waited out the 10 s
