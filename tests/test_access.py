"""Who may call what (s3flow.server.access, s3flow_client.channel), against a real tritonserver.

One server is started with every API category a streaming client does not need behind an admin key, and with
gRPC over TLS (a self-signed certificate made here). Checked: a restricted category without the key is
refused and with it answered, on gRPC and HTTP; health and inference stay open without it; a client that
trusts the certificate streams an utterance, a plaintext client and one that trusts another certificate get
nothing. The flag and argument checks run without a server.
"""
from __future__ import annotations

import datetime
import ipaddress
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from s3flow.engine.settings import SolverSettings
from s3flow.model.checkpoint import load_flow
from s3flow.model.random_checkpoint import write_random_checkpoint
from s3flow.model.flow import FlowConfig
from s3flow.repository.generator import write_repository
from s3flow.repository.settings import RepositorySettings
from s3flow.server.access import (ADMIN_KEY_HEADER, CATEGORIES, GRPC_ADMIN_KEY_HEADER, OPEN_GRPC, RESTRICTED_GRPC,
                                  RESTRICTED_HTTP, ServerTls, admin_headers, check_admin_key, restricted_api_flags)
from s3flow.server.install import find_tritonserver
from s3flow.server.triton_server import TritonServer
from s3flow_client import StreamingClient
from s3flow_client.channel import Channel
from s3flow_client.demo import demo_utterance

KEY = "test-admin-key-0123456789"


def self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost and its key (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / f"{name}.crt", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


# ------------------------------------------------------------------------------------------ no server
def test_restricted_flags_name_only_categories_tritonserver_knows():
    out = subprocess.run([str(find_tritonserver().binary), "--help"], capture_output=True, text=True)
    help_text = out.stdout + out.stderr
    flags = restricted_api_flags(KEY)
    assert [f.split("=", 1)[0] for f in flags] == ["--grpc-restricted-protocol", "--http-restricted-api"]
    for flag in flags:
        assert flag.split("=", 1)[0] in help_text
        categories, rule = flag.split("=", 1)[1].split(":")
        assert set(categories.split(",")) <= set(CATEGORIES) and rule == f"{ADMIN_KEY_HEADER}={KEY}"
    assert "inference" not in RESTRICTED_GRPC and "health" not in RESTRICTED_GRPC + RESTRICTED_HTTP
    assert set(RESTRICTED_GRPC) | set(OPEN_GRPC) == set(CATEGORIES)
    assert "Allowed protocols: " + ", ".join(CATEGORIES) in " ".join(help_text.split())


@pytest.mark.parametrize("bad", ["short", "has,comma-0123456789", "has:colon-0123456789", "has=equals-012345678",
                                 "has space-0123456789"])
def test_an_admin_key_the_flag_syntax_would_split_is_refused(bad):
    with pytest.raises(ValueError, match="admin key"):
        check_admin_key(bad)


def test_tools_send_the_key_from_the_environment(monkeypatch):
    monkeypatch.delenv("S3FLOW_ADMIN_KEY", raising=False)
    assert admin_headers() == {}
    monkeypatch.setenv("S3FLOW_ADMIN_KEY", KEY)
    assert admin_headers() == {GRPC_ADMIN_KEY_HEADER: KEY} and admin_headers("other") == {GRPC_ADMIN_KEY_HEADER: "other"}
    assert admin_headers(protocol="http") == {ADMIN_KEY_HEADER: KEY}


def test_tls_settings_name_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="certificate=.*no such file"):
        ServerTls(tmp_path / "none.crt", tmp_path / "none.key").flags()
    with pytest.raises(ValueError, match="root_certificates=.*no such file"):
        Channel(root_certificates=tmp_path / "none.crt")
    cert, key = self_signed(tmp_path, "a")
    with pytest.raises(ValueError, match="both private_key and certificate_chain"):
        Channel(root_certificates=cert, private_key=key)


def test_client_cli_refuses_a_malformed_header():
    out = subprocess.run([sys.executable, "-m", "s3flow_client", "voices", "list", "--header", "no-equals"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--header 'no-equals': expected KEY=VALUE" in out.stderr


# ------------------------------------------------------------------------------------------ one server
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("access")
    flow = load_flow(write_random_checkpoint(root / "ckpt.safetensors", FlowConfig.small(), seed=3))
    write_repository(root / "repo", flow, RepositorySettings(solver=SolverSettings.of(max_steps=4), ort_threads=1))
    cert, key = self_signed(root, "server")
    srv = TritonServer(root / "repo", log_file=root / "server.log", admin_key=KEY, tls=ServerTls(cert, key),
                       background_stop=True)
    with srv:
        srv.certificate = cert
        srv.other_certificate = self_signed(root, "other")[0]
        yield srv


@pytest.mark.server
def test_the_server_log_does_not_show_the_admin_key(server):
    text = Path(server.log_file).read_text()
    assert "<admin key>" in text and KEY not in text


@pytest.mark.server
def test_restricted_grpc_categories_need_the_key(server):
    client = grpcclient.InferenceServerClient(server.grpc_url, ssl=True, root_certificates=str(server.certificate))
    calls = {"statistics": lambda **h: client.get_inference_statistics("estimator", **h),
             "model-config": lambda **h: client.get_model_config("token2mel", **h),
             "model-repository": lambda **h: client.get_model_repository_index(**h)}
    try:
        for category, call in calls.items():
            assert category in RESTRICTED_GRPC
            with pytest.raises(InferenceServerException, match=ADMIN_KEY_HEADER):
                call()
            with pytest.raises(InferenceServerException, match=ADMIN_KEY_HEADER):
                call(headers={GRPC_ADMIN_KEY_HEADER: "wrong-key-0123456789"})
            assert call(headers=admin_headers(KEY)) is not None, category
        assert client.is_server_ready() and client.get_model_metadata("token2mel").name == "token2mel"  # open
    finally:
        client.close()


@pytest.mark.server
def test_http_keeps_only_health_open(server):
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        assert client.is_server_live() and client.is_server_ready()
        with pytest.raises(InferenceServerException, match=ADMIN_KEY_HEADER):
            client.get_model_metadata("token2mel")
        assert client.get_model_metadata("token2mel", headers=admin_headers(KEY, "http"))["name"] == "token2mel"
    finally:
        client.close()


@pytest.mark.server
def test_a_client_that_trusts_the_certificate_streams_without_the_key(server):
    u = demo_utterance(1.0, seed=1)
    u.n_timesteps, u.chunks = 2, [10, 15]
    [r] = StreamingClient(server.grpc_url, timeout_s=60,
                          channel=Channel(root_certificates=server.certificate)).synthesize([u])
    assert r.error is None and r.mel.shape == (80, 50) and np.isfinite(r.mel).all()


@pytest.mark.server
@pytest.mark.parametrize("who", ["plaintext", "trusts another certificate"])
def test_a_client_without_the_certificate_gets_nothing(server, who):
    if who == "plaintext":
        client = grpcclient.InferenceServerClient(server.grpc_url)
    else:
        client = grpcclient.InferenceServerClient(server.grpc_url, ssl=True,
                                                  root_certificates=str(server.other_certificate))
    try:
        with pytest.raises(InferenceServerException):
            client.is_server_live(client_timeout=5)
    finally:
        client.close()
    u = demo_utterance(1.0, seed=2)
    u.n_timesteps, u.chunks = 2, [25]
    channel = Channel() if who == "plaintext" else Channel(root_certificates=server.other_certificate)
    client = StreamingClient(server.grpc_url, timeout_s=20, response_timeout_s=10, max_resumes=0, channel=channel)
    with pytest.raises(Exception):
        client.synthesize([u])
