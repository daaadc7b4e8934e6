"""A warm start for the programs a test's Flower processes start by name: a zygote that imported a program's modules
once forks a child for each start, so that a ClientApp begins work without 5-8 s of importing torch and fedaudit.

Flower's SuperExec starts ``flwr-clientapp`` once per message (one token, one message, one process), found on PATH.
:class:`Zygote` puts an executable of that name first on PATH, a shim that runs without ``site`` (a few milliseconds):
it hands its argument list, working directory, environment and standard streams (the descriptors themselves) to the
zygote over a Unix socket, and the zygote forks a child that runs the program's own entry point with them. The child is
a real process running Flower's own code; it dies with its shim (a SuperNode's process group killed takes its
ClientApps with it, as it would without the zygote), the shim forwards SIGTERM and SIGINT to it, and the shim exits
with the child's exit status. A test may also start a program itself (:meth:`Zygote.start`: the child's own pid, its
output in files), and a script's path may be a program of its own (run as ``python SCRIPT`` runs it). The zygote
itself is stopped by its pid (:meth:`Zygote.close`), also when a test fails, and ends when its test process dies.

The zygote only imports: it starts no thread and creates no gRPC channel or torch thread pool before it forks, so each
child starts from the state a fresh interpreter would have after the same imports. Python reseeds ``random`` in a
forked child; fedaudit seeds every other generator it uses itself.
"""

from __future__ import annotations

import array
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

FDS = 3  # the shim's stdin, stdout and stderr travel with its request
MAX_REQUEST = 1 << 20

# The shim: stdlib only, run with -S. It sends {argv, cwd, env} and its descriptors 0-2, reads the child's pid, then
# waits for the child's exit status (a line), forwarding SIGTERM and SIGINT.
SHIM = """\
import array, json, os, signal, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(ZYGOTE)
request = json.dumps({"entry": ENTRY, "argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
streams = array.array("i", [0, 1, 2])
sock.sendmsg([len(request).to_bytes(8, "big") + request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, streams)])
stream = sock.makefile("rb")
pid = int(stream.readline())
def forward(signum, frame):
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass
signal.signal(signal.SIGTERM, forward)
signal.signal(signal.SIGINT, forward)
line = stream.readline()
code = int(line) if line.strip() else 1
if code < 0:  # killed by a signal: so is the shim
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: its length-prefixed JSON and the descriptors sent with its first bytes."""
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(MAX_REQUEST, socket.CMSG_SPACE(FDS * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    size = int.from_bytes(data[:8], "big")
    body = data[8:]
    while len(body) < size:
        more = conn.recv(size - len(body))
        if not more:
            raise ConnectionError("the shim left before its request was complete")
        body += more
    return json.loads(body), list(fds)


def _search_path(request: dict, base: list[str]) -> list[str]:
    """The module search path the program would start with: its own folder, the PYTHONPATH it was given, then the
    interpreter's own entries (``base``)."""
    given = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    return [os.path.dirname(request["argv"][0]), *given, *base]


def _die_with_shim(conn: socket.socket) -> None:
    """Kill this process when its shim is gone (the shim never writes after its request: the read ends with it)."""
    with contextlib.suppress(OSError):
        conn.recv(1)
    os.kill(os.getpid(), signal.SIGKILL)


def _child(conn: socket.socket, listener: socket.socket, request: dict, fds: list[int], base: list[str]) -> None:
    """In the forked child: become the program the shim was started as, and die with the shim."""
    listener.close()
    if request.get("session"):  # a process group of its own, which a test stops by the child's pid
        os.setsid()
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    os.chdir(request["cwd"])
    sys.path[:] = _search_path(request, base)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])
    threading.Thread(target=_die_with_shim, args=(conn,), daemon=True).start()
    entry = request["entry"]
    code = 0
    try:
        if entry.endswith(".py"):  # a script, run as `python SCRIPT` runs it
            runpy.run_path(entry, run_name="__main__")
        else:
            module, _, function = entry.partition(":")
            result = getattr(importlib.import_module(module), function)()
            code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the program would report it, then the exit status
        import traceback

        traceback.print_exc()
        code = 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve(path: str, preload: list[str]) -> None:
    """The zygote's loop: import ``preload``, then fork a child for every request and report its exit status."""
    base = sys.path[1:]  # the interpreter's own search path (the zygote runs without PYTHONPATH): each child's follows
    for module in preload:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # a zygote whose test process died (killed past its finalisers) ends with it
        ready, _, _ = select.select([listener], [], [], 0.05)
        if ready:
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError, ConnectionError):
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                try:
                    _child(conn, listener, request, fds, base)
                finally:
                    os._exit(1)  # a child never returns into the zygote's loop
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.sendall(f"{pid}\n".encode())
            children[pid] = conn
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
    os.killpg(0, signal.SIGKILL)


class Zygote:
    """A zygote process for the programs ``entries`` names (program name -> ``module:function``), started now and
    stopped by :meth:`close`; :attr:`bin` holds their shims, to put first on PATH."""

    def __init__(self, directory: Path, entries: dict[str, str], preload: list[str]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.entries = dict(entries)
        self.socket = directory / "zygote.sock"
        self.socket.unlink(missing_ok=True)  # a stale one would look like this zygote's
        self.bin = directory / "bin"
        self.bin.mkdir(exist_ok=True)
        for program, entry in entries.items():
            if os.sep in program:  # a script's path, started with start() only: no shim (it would overwrite it)
                continue
            shim = self.bin / program
            header = f"#!{sys.executable} -S\nZYGOTE = {str(self.socket)!r}\nENTRY = {entry!r}\n"
            shim.write_text(header + SHIM)
            shim.chmod(0o755)
        with open(directory / "zygote.log", "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, __file__, str(self.socket), *preload],
                stdin=subprocess.DEVNULL,  # descriptors 0-2 taken: a received one is never one of them
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # without PYTHONPATH: a child gets its own, before the interpreter's path (a test process's may name
                # anything, even site-packages, which the interpreter then leaves out of its own path: Ray adds to it).
                # No Flower telemetry: Flower reads the setting once, when the zygote imports it, so a child's own
                # environment cannot turn it off (every SuperNode tried to post its start to Flower's server).
                env={
                    **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                    "OMP_NUM_THREADS": "1",
                    "FLWR_TELEMETRY_ENABLED": "0",
                },
            )
        deadline = time.monotonic() + 120
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the zygote did not start: {(directory / 'zygote.log').read_text()[-2000:]}")
            time.sleep(0.05)

    def start(
        self,
        program: str,
        args: list[str],
        *,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        stdout: Path | None = None,
        stderr: Path | None = None,
        new_session: bool = False,
    ) -> Forked:
        """``program`` (one of the entries: a name, or a script's path that is its own entry) with ``args``, forked
        now, its output written to ``stdout`` and ``stderr`` (files, the same one for both if they are the same path;
        appended to) or discarded: a handle with the child's own pid, as :class:`subprocess.Popen` would give (the
        test's connection plays the shim). ``new_session``: the child leads a session and process group of its own,
        as ``Popen(start_new_session=True)`` starts it."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self.socket))
        request = {
            "entry": self.entries[program],
            "argv": [program, *map(str, args)],
            "cwd": str(cwd or Path.cwd()),
            "env": dict(os.environ if env is None else env),
            "session": new_session,
        }
        body = json.dumps(request).encode()
        with contextlib.ExitStack() as files:
            null = files.enter_context(open(os.devnull, "r+b"))
            out = null if stdout is None else files.enter_context(open(stdout, "ab"))
            err = out if stderr == stdout else null if stderr is None else files.enter_context(open(stderr, "ab"))
            fds = array.array("i", [null.fileno(), out.fileno(), err.fileno()])
            conn.sendmsg([len(body).to_bytes(8, "big") + body], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        return Forked(conn)

    def close(self) -> None:
        """Stop the zygote by its pid (its children die with their shims)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class Forked:
    """A child of the zygote started by :meth:`Zygote.start`: its pid, and ``poll``/``wait`` as in
    :class:`subprocess.Popen` (the exit status comes from the zygote, which reaps it)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buffer = b""
        self.pid = int(self._line(None))
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> bytes | None:
        """The next line from the zygote, or None when none came within ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            more = self._conn.recv(4096)
            if not more:
                self._buffer += b"\n"  # the zygote is gone: no status
                break
            self._buffer += more
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def poll(self) -> int | None:
        return self._status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0)
        return code

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            line = self._line(timeout)
            if line is not None:
                self.returncode = int(line) if line.strip() else 1
                self._conn.close()
        return self.returncode


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
