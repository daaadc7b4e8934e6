"""A real Flower deployment on 127.0.0.1 for tests: TLS files, one SuperLink and SuperNodes as separate processes.

Every process is started in its own process group with its output in a log file (never a pipe: Flower's
grandchildren would hold it open), and :meth:`Federation.close` stops each group by the pid the test got from
``Popen``, also when the test fails.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode and what they start by name


def make_tls_files(directory: Path, host: str = "127.0.0.1") -> dict[str, Path]:
    """A throwaway CA and a server certificate for ``host``: ca.crt, server.pem, server.key (PEM)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedaudit test CA")])
    usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=True,
        crl_sign=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        encipher_only=False,
        decipher_only=False,
    )
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    files = {"ca": directory / "ca.crt", "cert": directory / "server.pem", "key": directory / "server.key"}
    files["ca"].write_bytes(ca_cert.public_bytes(pem))
    files["cert"].write_bytes(cert.public_bytes(pem))
    files["key"].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    files["key"].chmod(0o600)
    return files


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Federation:
    """One TLS SuperLink (``--isolation process``: fedaudit is the server) and SuperNodes, on 127.0.0.1."""

    def __init__(self, directory: Path, *, task_poll_seconds: float | None = 0.1) -> None:
        """``task_poll_seconds``: how often each SuperNode's SuperExec asks for new work (Flower's default, 1 s, when
        None; tests use 0.1 s so that rounds start sooner)."""
        self.directory = directory
        self.task_poll_seconds = task_poll_seconds
        self.tls = make_tls_files(directory / "certs")
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.processes: dict[str, subprocess.Popen] = {}

    def _env(self, name: str) -> dict[str, str]:
        home = self.directory / "flwr-home" / name
        home.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "OMP_NUM_THREADS": "1",
        }
        if self.task_poll_seconds is not None:
            env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(self.task_poll_seconds)
        return env

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.directory / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                argv, env=self._env(name), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.processes[name] = process
        return process

    def start_superlink(self) -> None:
        tls = self.tls
        self._spawn(
            "superlink",
            [
                str(BIN / "flower-superlink"),
                *("--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"])),
                *("--ssl-keyfile", str(tls["key"]), "--host", "127.0.0.1", "--port", str(self.port)),
                *("--isolation", "process", "--disable-runtime-dependency-installation"),
            ],
        )
        context = ssl.create_default_context(cafile=str(tls["ca"]))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"https://{self.address}/health", verify=context, timeout=2).status_code == 200:
                    return
            if self.processes["superlink"].poll() is not None:
                break
            time.sleep(0.3)
        raise RuntimeError(f"the SuperLink did not come up: {self.log('superlink')}")

    def secret_path(self, client: int) -> Path:
        """Where the site of ``client`` keeps its secret (unless its node config names another file)."""
        return self.directory / f"site-{client}" / "secret.json"

    def start_supernode(
        self, client: int, node_config: str | None = None, *, public_noise: bool = False
    ) -> subprocess.Popen:
        """A SuperNode hosting ``client``; its node config, unless given: ``client-id=CLIENT`` and its secret's file
        (:meth:`secret_path`), with ``public-noise=true`` when the site lets the server choose a --noise-seed."""
        config = node_config or f'client-id={client} secret="{self.secret_path(client)}"'
        if public_noise:
            config += " public-noise=true"
        return self._spawn(
            f"supernode-{client}",
            [
                str(BIN / "flower-supernode"),
                *("--superlink", self.address, "--root-certificates", str(self.tls["ca"])),
                *("--port", str(free_port()), "--node-config", config),
            ],
        )

    def kill(self, name: str) -> None:
        """SIGKILL one process (a site that dies), and reap it so that its children notice."""
        process = self.processes[name]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def log(self, name: str) -> str:
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def close(self) -> None:
        """Stop every process group the federation started: SuperNodes first, then the SuperLink."""
        for name in sorted(self.processes, key=lambda n: n == "superlink"):
            process = self.processes[name]
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # what is left of the group (its SuperExec, ClientApps)


class RayHead:
    """A Ray cluster's head node on 127.0.0.1 (``ray start --head --block``), in its own process group."""

    def __init__(self, directory: Path, cpus: int = 2) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = directory / "ray-head.log"
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "RAY_USAGE_STATS_ENABLED": "0"}
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    str(BIN / "ray"),
                    *("start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(self.port)),
                    *("--num-cpus", str(cpus), "--num-gpus", "0", "--include-dashboard", "false"),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                time.sleep(2)  # the head's other services come up just after its GCS port opens
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.5)
        self.close()
        raise RuntimeError(f"the Ray head did not come up: {self.log.read_text(errors='replace')[-2000:]}")

    def close(self) -> None:
        """Stop the head's process group by the pid the test got (SIGTERM lets ``ray start --block`` stop its
        services; SIGKILL whatever is left)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        current = Path("/tmp/ray/ray_current_cluster")  # where `ray start` says "a cluster runs here"
        with contextlib.suppress(OSError):
            if current.read_text().strip().endswith(f":{self.port}"):
                current.unlink()
