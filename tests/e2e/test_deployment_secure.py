"""A secure deployment on 127.0.0.1: TLS everywhere and SuperNode authentication.

The SuperLink serves its Fleet, Control and Runtime APIs (one HTTPS port in Flower 1.41)
with a certificate signed by a CA made here, and admits only SuperNodes whose public
keys were registered with `flwr supernode register`. Two registered SuperNodes run
2 rounds of FedAvg and DRFA; a third SuperNode with an unregistered key must be refused.
The certificates and keys are made with `cryptography` (a flwr dependency), so the test
needs neither openssl nor ssh-keygen; the README's Deployment section gives the same
files made with those tools.

The refused SuperNode is started with the two others and exits while they come online,
so the negative check adds no time. The run itself dominates: every message starts a
`flwr-clientapp` process (Flower's subprocess isolation), about 1.5 minutes of CPU in all.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import socket
import ssl
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ._flower import BIN, REPO, flower_env, flwr, free_port, json_out, start, stop, wait_run

pytestmark = pytest.mark.e2e


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_tls(folder: Path) -> tuple[Path, Path, Path]:
    """A self-signed CA (``ca.crt``) and a server certificate it signs for 127.0.0.1/localhost.

    Returns the paths of ``ca.crt``, ``server.pem`` and ``server.key`` (PEM, unencrypted).
    """
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flowerdro test CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "ca.crt", folder / "server.pem", folder / "server.key"
    paths[0].write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(_pem_key(key))
    return paths


def _write_node_keys(folder: Path, name: str) -> tuple[Path, Path]:
    """An EC (NIST P-384) key pair in OpenSSH format, as `ssh-keygen -t ecdsa -b 384` writes it.

    flower-supernode reads the private key with `load_ssh_private_key` and
    `flwr supernode register` the public key with `load_ssh_public_key`.
    """
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / name, folder / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n")
    private.chmod(0o600)
    return private, public


def _pem_body_line(public_key: Path) -> str:
    """A base64 line of the SubjectPublicKeyInfo PEM the SuperLink logs for a refused key."""
    key = serialization.load_ssh_public_key(public_key.read_bytes())
    pem = key.public_bytes(serialization.Encoding.PEM,
                           serialization.PublicFormat.SubjectPublicKeyInfo).decode()
    return pem.splitlines()[2]  # past the header and the curve-specific first line


def _tls_version(port: int, server_hostname: str, cafile: Path | None) -> str:
    """TLS handshake with 127.0.0.1:port, verifying the certificate against ``cafile``.

    Strict X.509 checks, as Python 3.13's default context makes them (SuperNode clients).
    """
    ctx = ssl.create_default_context(cafile=str(cafile) if cafile else None)
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    with (socket.create_connection(("127.0.0.1", port), timeout=30) as sock,
          ctx.wrap_socket(sock, server_hostname=server_hostname) as tls):
        return str(tls.version())


def _flwr_json(args: list[str], env: dict[str, str]) -> dict:
    """`flwr ARGS --format json` answer; these commands exit 0 on failure, so read "success"."""
    proc = flwr([*args, "--format", "json"], env)
    try:
        return json_out(proc.stdout)
    except ValueError:
        return {"success": False, "error-message": proc.stdout + proc.stderr}


def _online_node_ids(env: dict[str, str]) -> list[str]:
    answer = _flwr_json(["supernode", "list", "secure"], env)
    assert answer.get("success"), answer
    return sorted(n["node-id"] for n in answer["nodes"] if n["status"] == "online")


def test_secure_deployment_tls_and_supernode_auth(tmp_path):
    """TLS + `--enable-supernode-auth`: 2 registered SuperNodes run 2 rounds, a 3rd is refused."""
    home, out, certs = tmp_path / "home", tmp_path / "out", tmp_path / "certs"
    home.mkdir()
    certs.mkdir()
    ca, server_cert, server_key = _write_tls(certs)
    keys = [_write_node_keys(certs, f"node{i}") for i in range(2)]
    intruder_key, intruder_pub = _write_node_keys(certs, "intruder")
    port = free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "secure"\n\n[superlink.secure]\naddress = "127.0.0.1:{port}"\n'
        f'root-certificates = "{ca}"\n'
    )
    env = flower_env(home)
    procs: list[subprocess.Popen] = []
    logs = {}

    def launch(name: str, cmd: list[str]) -> subprocess.Popen:
        logs[name] = open(tmp_path / f"{name}.log", "w")
        procs.append(start(cmd, env, logs[name]))
        return procs[-1]

    def log_tail(name: str) -> str:
        return f"--- {name}.log ---\n" + (tmp_path / f"{name}.log").read_text()[-3000:]

    try:
        launch("superlink", [
            str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(ca),
            "--ssl-certfile", str(server_cert), "--ssl-keyfile", str(server_key),
            "--enable-supernode-auth", "--disable-runtime-dependency-installation",
            "--host", "127.0.0.1", "--port", str(port)])
        # register the two SuperNodes' public keys (retry while the SuperLink starts up)
        node_ids = []
        for _, public in keys:
            deadline = time.monotonic() + 90
            while True:
                answer = _flwr_json(["supernode", "register", str(public), "secure"], env)
                if answer.get("success") or time.monotonic() > deadline:
                    break
                time.sleep(2)
            assert answer.get("success"), str(answer) + log_tail("superlink")
            node_ids.append(str(answer["node-id"]))
        # TLS is on, and the certificate verifies for both SANs against our CA only
        for name in ("127.0.0.1", "localhost"):
            assert _tls_version(port, name, ca) in {"TLSv1.2", "TLSv1.3"}
        with pytest.raises(ssl.SSLCertVerificationError):
            _tls_version(port, "127.0.0.1", None)
        for i, (private, _) in enumerate(keys):
            launch(f"supernode{i}", [
                str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}",
                "--root-certificates", str(ca), "--auth-supernode-private-key", str(private),
                "--node-config", f"partition-id={i} num-partitions=2",
                "--host", "127.0.0.1", "--port", str(free_port())])
        # same TLS settings, valid key pair, but never registered; it would be partition 2
        intruder = launch("intruder", [
            str(BIN / "flower-supernode"), "--superlink", f"127.0.0.1:{port}",
            "--root-certificates", str(ca), "--auth-supernode-private-key", str(intruder_key),
            "--node-config", "partition-id=2 num-partitions=3",
            "--host", "127.0.0.1", "--port", str(free_port()), "--max-retries", "2"])

        deadline = time.monotonic() + 90
        while len(online := _online_node_ids(env)) < 2 and time.monotonic() < deadline:
            time.sleep(2)
        assert online == sorted(node_ids), (
            str(online) + log_tail("supernode0") + log_tail("supernode1"))

        # Negative check: the SuperLink refuses to activate the unregistered key (it logs the
        # key it refused) and that SuperNode gives up with an error (Flower exit code 305).
        try:
            code = intruder.wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("unregistered SuperNode still running after 90 s\n" + log_tail("intruder"))
        intruder_log = (tmp_path / "intruder.log").read_text()
        assert code != 0, intruder_log
        assert "Failed to initialize the connection to the SuperLink" in intruder_log, intruder_log
        assert "Failed to activate SuperNode" in intruder_log, intruder_log
        refusals = [line for line in (tmp_path / "superlink.log").read_text().splitlines()
                    if "No SuperNode found with the given public key" in line]
        assert any(_pem_body_line(intruder_pub) in line for line in refusals), log_tail("superlink")

        sub = flwr(["run", str(REPO), "secure", "--format", "json", "--run-config",
                    f"num-rounds=2 strategies='fedavg,drfa' output-dir='{out}'"], env, timeout=180)
        assert sub.returncode == 0, sub.stdout + sub.stderr + log_tail("superlink")
        run_id = str(json_out(sub.stdout)["run-id"])
        status = wait_run(run_id, env, timeout=900)  # each message starts a ClientApp process
        assert status == "finished:completed", (
            log_tail("superlink") + log_tail("supernode0") + log_tail("supernode1"))

        for name in ("fedavg", "drfa"):
            rounds = [json.loads(x) for x in (out / name / "rounds.jsonl").read_text().splitlines()]
            assert [r["round"] for r in rounds] == [1, 2]
            # exactly the two registered partitions took part; the refused node (2) did not
            assert sorted(rounds[-1]["client_acc"]) == ["0", "1"]
            assert not any(r["failures"] for r in rounds)
            assert all(0.0 <= a <= 1.0 for a in rounds[-1]["client_acc"].values())
        lam = json.loads((out / "drfa" / "rounds.jsonl").read_text().splitlines()[-1])["lambda"]
        assert sorted(lam) == ["0", "1"]
        # λ is float64 on the simplex and JSON keeps float64 exactly: the sum is within n·eps
        # (2.2e-16) of 1; 1e-9 is ample
        assert abs(sum(lam.values()) - 1.0) < 1e-9 and min(lam.values()) >= 0.0
        # the two registered nodes are still the only ones the SuperLink knows as online
        assert _online_node_ids(env) == sorted(node_ids)
    finally:
        stop(procs)
        for log in logs.values():
            log.close()
