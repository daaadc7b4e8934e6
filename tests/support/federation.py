"""A real Flower deployment on 127.0.0.1 for tests: TLS files, one SuperLink and SuperNodes as separate processes.

Every process is started in its own process group with its output in a log file (never a pipe: Flower's
grandchildren would hold it open), and :meth:`Federation.close` (a test's SuperNodes) and :meth:`SuperLink.close`
stop each group by the pid the test got (from ``Popen``, or from the zygote that forked a SuperNode), also when the
test fails. One SuperLink may serve the federations of several tests in turn (started once for them), each test
starting and stopping its own SuperNodes.
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
from collections.abc import Sequence
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from zygote import Forked, Zygote

BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode and what they start by name

# What a ClientApp process imports before its first message, imported once by the zygote of a SuperLink's
# federations (tests/support/zygote.py): Flower's flwr-clientapp, torch and fedaudit's ClientApp with the algorithms
# it runs; and Flower's SuperExec, which every SuperNode starts by name (another second of imports a SuperNode).
# Each ClientApp and SuperExec still is a process of its own, started by Flower's own code by name.
CLIENTAPP = {
    "flwr-clientapp": "flwr.supernode.cli.flwr_clientapp:flwr_clientapp",
    "flower-superexec": "flwr.supercore.cli:flower_superexec",
}
CLIENTAPP_IMPORTS = [
    "torch",
    "flwr.supercore.cli",
    "flwr.supernode.cli.flwr_clientapp",
    "flwr.clientapp",
    "flwr.app",
    "fedaudit.engine.deployment",
    "fedaudit.instruments.record_signals",
    "fedaudit.algorithms.fedavg",
    "fedaudit.algorithms.fedlap",
]

# What a SuperNode imports, imported once by the same zygote: each SuperNode is forked from it (a process group of its
# own, as if started by Popen) instead of spending a second or more importing Flower.
SUPERNODE_IMPORTS = [
    "flwr.supercore.heartbeat",
    "flwr.supernode.fleet_http_connection",
    "flwr.supernode.start_client_internal",
    "flwr.supernode.cli",
    "httpcore",  # what httpx's transport imports when a SuperNode opens its connection (about 0.5 s each)
]

# flower-supernode with two of Flower's constants replaced, each unless its argument is "-": the heartbeat interval it
# declares (Flower's own CLI always declares HEARTBEAT_DEFAULT_INTERVAL, 30 s; the SuperLink accepts any from
# HEARTBEAT_MIN_INTERVAL, 10 s, and declares a SuperNode that sent none for two intervals offline), and the longest
# wait between its requests for messages (Flower waits 3 s after a pull that found none, 0.5 s between looks for a
# reply: 1-2 s of every exchange of a test's federation; 0.2 s costs an idle node a request every 0.2 s)
SUPERNODE = """
import sys
import time
import flwr.supercore.heartbeat as heartbeat
import flwr.supernode.fleet_http_connection as fleet
import flwr.supernode.start_client_internal as internal
heartbeat_seconds, poll_seconds = sys.argv.pop(1), sys.argv.pop(1)
if heartbeat_seconds != "-":
    heartbeat.HEARTBEAT_DEFAULT_INTERVAL = fleet.HEARTBEAT_DEFAULT_INTERVAL = float(heartbeat_seconds)
if poll_seconds != "-":
    longest = float(poll_seconds)
    class Time:
        def __getattr__(self, name):
            return getattr(time, name)
        @staticmethod
        def sleep(seconds):
            time.sleep(min(seconds, longest))
    internal.time = Time()
from flwr.supernode.cli import flower_supernode
sys.exit(flower_supernode())
"""


# flower-superlink accepting heartbeat intervals from SHORTEST_HEARTBEAT seconds (Flower's HEARTBEAT_MIN_INTERVAL is
# 10 s): a test's site that is going to die declares a short one, so that the SuperLink says it is gone after twice
# that instead of after 20 s or more (the wait was most of the kill-and-resume test's time)
SUPERLINK = """
import sys
import flwr.superlink.servicer.fleet.fleet_handlers as handlers
handlers.HEARTBEAT_MIN_INTERVAL = float(sys.argv.pop(1))
from flwr.superlink.cli import flower_superlink
sys.exit(flower_superlink())
"""
SHORTEST_HEARTBEAT = 2.0


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


def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """``argv`` in its own process group (a new session), its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _env(home: Path, task_poll_seconds: float | None = None, first: Path | None = None) -> dict[str, str]:
    """The environment of a Flower process: ``first`` (a zygote's shims) and this venv's programs first on PATH, its
    own FLWR_HOME, no telemetry."""
    home.mkdir(parents=True, exist_ok=True)
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {
        **os.environ,
        "PATH": path if first is None else f"{first}{os.pathsep}{path}",
        "FLWR_HOME": str(home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "OMP_NUM_THREADS": "1",
    }
    if task_poll_seconds is not None:
        env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = str(task_poll_seconds)
    return env


def _stop_groups(processes: Sequence[subprocess.Popen | Forked], timeout: float = 20) -> None:
    """Stop the process group of each of ``processes`` (each leads its own), by the pid the test got: SIGTERM
    to every group at once (each shuts down on its own, so they stop together rather than one after the other),
    SIGKILL to a process still running after ``timeout`` s, and to what is left of every group (its SuperExec,
    ClientApps)."""
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for process in processes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


class SuperLink:
    """A TLS SuperLink on 127.0.0.1 (``--isolation process``: fedaudit is the server), in its own process group; it
    serves the :class:`Federation` of one test after another, whose SuperNodes are forked from one :class:`Zygote`
    that the SuperLink keeps with it, and start their SuperExecs and ClientApps from it too."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.supernode = directory / "supernode.py"  # the zygote runs it as `python supernode.py` would
        self.supernode.write_text(SUPERNODE)
        entries = {**CLIENTAPP, str(self.supernode): str(self.supernode)}
        self.zygote = Zygote(directory / "zygote", entries, [*CLIENTAPP_IMPORTS, *SUPERNODE_IMPORTS])
        self.process: subprocess.Popen | None = None
        try:
            self.tls = make_tls_files(directory / "certs")
            self.port = free_port()
            self.address = f"127.0.0.1:{self.port}"
            tls = self.tls
            self.process = _spawn(
                [
                    *(sys.executable, "-c", SUPERLINK, str(SHORTEST_HEARTBEAT)),
                    *("--ssl-ca-certfile", str(tls["ca"]), "--ssl-certfile", str(tls["cert"])),
                    *("--ssl-keyfile", str(tls["key"]), "--host", "127.0.0.1", "--port", str(self.port)),
                    *("--isolation", "process", "--disable-runtime-dependency-installation"),
                ],
                _env(directory / "flwr-home"),
                directory / "superlink.log",
            )
            self._wait()
        except BaseException:
            self.close()
            raise

    def _wait(self) -> None:
        context = ssl.create_default_context(cafile=str(self.tls["ca"]))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"https://{self.address}/health", verify=context, timeout=2).status_code == 200:
                    return
            if self.process is None or self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the SuperLink did not come up: {self.log()}")

    def log(self) -> str:
        path = self.directory / "superlink.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def close(self) -> None:
        """Stop the SuperLink's process group, then the zygote."""
        try:
            if self.process is not None:
                _stop_groups([self.process])
        finally:
            self.zygote.close()


class Federation:
    """One test's SuperNodes on a :class:`SuperLink`: each in its own process group, every one stopped by
    :meth:`close`."""

    def __init__(
        self,
        superlink: SuperLink,
        directory: Path,
        *,
        task_poll_seconds: float | None = 0.1,
        message_poll_seconds: float | None = 0.2,
    ) -> None:
        """``task_poll_seconds``: how often each SuperNode's SuperExec asks for new work (Flower's default, 1 s, when
        None; tests use 0.1 s so that rounds start sooner); ``message_poll_seconds``: the longest wait of a SuperNode
        between its requests to the SuperLink (Flower's 3 s when None; see :data:`SUPERNODE`)."""
        self.superlink = superlink
        self.directory = directory
        self.task_poll_seconds = task_poll_seconds
        self.message_poll_seconds = message_poll_seconds
        self.tls = superlink.tls
        self.address = superlink.address
        self.processes: dict[str, Forked] = {}  # the current process of each name
        self.spawned: list[Forked] = []  # every process started, a killed site's too
        directory.mkdir(parents=True, exist_ok=True)

    def secret_path(self, client: int) -> Path:
        """Where the site of ``client`` keeps its secret (unless its node config names another file)."""
        return self.directory / f"site-{client}" / "secret.json"

    def start_supernode(
        self,
        client: int,
        node_config: str | None = None,
        *,
        public_noise: bool = False,
        heartbeat_seconds: float | None = None,
    ) -> Forked:
        """A SuperNode hosting ``client``; its node config, unless given: ``client-id=CLIENT`` and its secret's file
        (:meth:`secret_path`), with ``public-noise=true`` when the site lets the server choose a --noise-seed.
        ``heartbeat_seconds``: the heartbeat interval it declares instead of Flower's 30 s (at least
        :data:`SHORTEST_HEARTBEAT`), for a site that is going to die: the SuperLink then says it is gone after twice
        that, not after a minute."""
        config = node_config or f'client-id={client} secret="{self.secret_path(client)}"'
        if public_noise:
            config += " public-noise=true"
        name = f"supernode-{client}"
        replaced = (heartbeat_seconds, self.message_poll_seconds)
        args = [
            *("-" if value is None else str(value) for value in replaced),
            *("--superlink", self.address, "--root-certificates", str(self.tls["ca"])),
            *("--port", str(free_port()), "--node-config", config),
        ]
        zygote = self.superlink.zygote
        env = _env(self.directory / "flwr-home" / name, self.task_poll_seconds, zygote.bin)
        log = self.directory / f"{name}.log"
        script = str(self.superlink.supernode)
        self.processes[name] = process = zygote.start(script, args, env=env, stdout=log, stderr=log, new_session=True)
        self.spawned.append(process)
        return process

    def kill(self, name: str) -> None:
        """SIGKILL one process (a site that dies), and reap it so that its children notice."""
        process = self.processes[name]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()

    def log(self, name: str) -> str:
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def close(self) -> None:
        """Stop the process group of every SuperNode started, all at once (each tells the SuperLink it leaves)."""
        _stop_groups(self.spawned)


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
