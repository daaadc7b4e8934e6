"""The tests' zygote (tests/support/zygote.py): its children are processes of their own that run the program as it
would run, die with their shims and report their exit status; a script entry leaves the script untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from zygote import Zygote

PROGRAM = """
import os, sys, time
print("argv", sys.argv[1:], "cwd", os.getcwd(), "env", os.environ.get("ZYGOTE_TEST"), "pid", os.getpid(), flush=True)
print("on stderr", file=sys.stderr, flush=True)
if "wait" in sys.argv:
    time.sleep(60)
sys.exit(3)
"""


def test_children_run_the_program_as_their_own_process_and_die_with_their_shim(tmp_path: Path) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    zygote = Zygote(tmp_path / "zygote", {"program": "runpy:run_path", str(script): str(script)}, [])
    try:
        out, err = tmp_path / "out", tmp_path / "err"
        child = zygote.start(
            str(script), ["a", "b"], cwd=tmp_path, env={**os.environ, "ZYGOTE_TEST": "yes"}, stdout=out, stderr=err
        )
        assert child.wait(timeout=60) == 3
        said = out.read_text()
        assert f"argv ['a', 'b'] cwd {tmp_path} env yes pid {child.pid}" in said
        assert child.pid != os.getpid() and err.read_text() == "on stderr\n"
        assert script.read_text() == PROGRAM and sorted(p.name for p in zygote.bin.iterdir()) == ["program"]

        waiting = zygote.start(str(script), ["wait"])
        assert waiting.poll() is None
        os.kill(waiting.pid, signal.SIGKILL)
        assert waiting.wait(timeout=30) == -signal.SIGKILL

        env = {**os.environ, "PATH": f"{zygote.bin}{os.pathsep}{os.environ['PATH']}"}
        shim = subprocess.Popen(["program"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            shim.stdout.readline()  # runpy.run_path() without a path: the child fails, and says so with its status
            assert shim.wait(timeout=30) == 1
        finally:
            if shim.poll() is None:
                shim.kill()
                shim.wait()
    finally:
        zygote.close()
    assert zygote.process.poll() is not None


def test_a_child_dies_with_its_shim(tmp_path: Path) -> None:
    """The shim's process group killed (a SuperNode killed with its children): the forked program goes too."""
    (tmp_path / "program_entry.py").write_text(
        f"import runpy\ndef main():\n    runpy.run_path({str(tmp_path / 'program.py')!r}, run_name='__main__')\n"
    )
    (tmp_path / "program.py").write_text(PROGRAM)
    zygote = Zygote(tmp_path / "zygote", {"program": "program_entry:main"}, [])
    try:
        env = {**os.environ, "PATH": f"{zygote.bin}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(tmp_path)}
        shim = subprocess.Popen(["program", "wait"], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
        try:
            child = int(shim.stdout.readline().split()[-1])
            assert child != shim.pid
            os.killpg(shim.pid, signal.SIGKILL)
            shim.wait()
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(child):
                time.sleep(0.05)
            assert not _alive(child)
        finally:
            if shim.poll() is None:
                os.killpg(shim.pid, signal.SIGKILL)
                shim.wait()
    finally:
        zygote.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_child_in_a_session_of_its_own_is_stopped_with_its_group(tmp_path: Path) -> None:
    """``new_session``: the child leads its own process group (as ``Popen(start_new_session=True)``), so that a test
    stops it and what it started by the pid it got; its two streams go to one file, appended to."""
    script = tmp_path / "program.py"
    script.write_text(
        "import subprocess, sys, time\n"
        "print('out', flush=True)\nprint('err', file=sys.stderr, flush=True)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', child.pid, flush=True)\ntime.sleep(60)\n"
    )
    log = tmp_path / "log"
    log.write_text("before\n")
    zygote = Zygote(tmp_path / "zygote", {str(script): str(script)}, [])
    try:
        child = zygote.start(str(script), [], stdout=log, stderr=log, new_session=True)
        deadline = time.monotonic() + 30
        while "grandchild" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        grandchild = int(log.read_text().split()[-1])
        assert os.getpgid(child.pid) == child.pid == os.getsid(child.pid) != os.getpgid(0)
        assert os.getpgid(grandchild) == child.pid
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
        while time.monotonic() < deadline and _alive(grandchild):
            time.sleep(0.05)
        assert not _alive(grandchild)
        assert log.read_text().splitlines()[:3] == ["before", "out", "err"]
    finally:
        zygote.close()


def test_a_child_of_a_zygote_that_imported_flower_sends_no_telemetry(tmp_path: Path) -> None:
    """Flower reads FLWR_TELEMETRY_ENABLED once, when it is imported, which for a forked SuperNode is when the zygote
    imported it: the zygote itself runs with telemetry off, so that no test's SuperNode posts to Flower's server."""
    script = tmp_path / "telemetry.py"
    script.write_text("import flwr.supercore.telemetry as t\nprint('enabled', t.FLWR_TELEMETRY_ENABLED, flush=True)\n")
    zygote = Zygote(tmp_path / "zygote", {str(script): str(script)}, ["flwr.supercore.telemetry"])
    try:
        out = tmp_path / "out"
        env = {k: v for k, v in os.environ.items() if k != "FLWR_TELEMETRY_ENABLED"}
        assert zygote.start(str(script), [], env=env, stdout=out).wait(timeout=60) == 0
        assert out.read_text() == "enabled 0\n"
    finally:
        zygote.close()
