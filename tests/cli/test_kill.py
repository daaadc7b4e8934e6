"""Real processes: ``fedaudit train`` killed with SIGKILL at several moments of its start and its rounds, then the
same command again (or ``--resume``), must end byte for byte like an uninterrupted run with no stray file; and a
second writer of a run that another process is training is refused with the holder's pid. Every process a test
starts is killed by its pid in a ``finally``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import FAST_ARGS, assert_user_error, invoke

from fedaudit.runs import RunDirectory

SLOW = (*FAST_ARGS, "--rounds", "4", "--local-epochs", "4")  # long enough to be caught in its rounds
TIMEOUT = 120


def spawn(*args: str | Path) -> subprocess.Popen:
    code = "import sys; from fedaudit.cli import main; sys.exit(main())"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-c", code, *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def kill_when(process: subprocess.Popen, ready: Callable[[], bool]) -> bool:
    """SIGKILL ``process`` as soon as ``ready()`` holds; False when it finished first."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and process.poll() is None:
        if ready():
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            return True
        time.sleep(0.002)
    return False


def _partials(folder: Path) -> list[Path]:
    return sorted(folder.glob(".run.partial-*"))


def _rounds_done(run: Path) -> int:
    try:
        return json.loads((run / "manifest.json").read_text())["rounds_done"]
    except (OSError, ValueError, KeyError):
        return -1


MOMENTS: dict[str, Callable[[Path], bool]] = {
    "start-up: temporary directory made": lambda folder: bool(_partials(folder)),
    "start-up: manifest written": lambda folder: any((p / "manifest.json").exists() for p in _partials(folder)),
    "round 2 under way": lambda folder: _rounds_done(folder / "run") >= 1,
    "round 3 committing": lambda folder: (folder / "run" / "checkpoints" / "round-0003.safetensors").exists(),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    assert invoke("train", *SLOW, "--out", out).exit_code == 0
    return out


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_kill_9_at_any_moment_then_the_same_command_again_gives_the_same_run(reference, tmp_path, moment):
    out = tmp_path / "run"
    process = spawn("train", *SLOW, "--out", out)
    try:
        if not kill_when(process, lambda: MOMENTS[moment](tmp_path)):
            pytest.skip(f"the run finished before {moment}")
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    if out.exists():
        assert RunDirectory(out).integrity_problems() == []
        result = invoke("train", "--resume", out, "--no-progress")
    else:
        result = invoke("train", *SLOW, "--out", out)
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "metrics.csv", "checkpoints/round-0004.safetensors"):
        if name == "metrics.csv":
            continue  # holds wall-clock seconds
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert not list(out.rglob("*.tmp"))
    assert RunDirectory(out).integrity_problems() == []


def test_a_run_being_trained_refuses_a_second_writer_naming_its_pid(reference, tmp_path):
    out = tmp_path / "run"
    assert invoke("train", *SLOW, "--rounds", "1", "--out", out).exit_code == 0
    process = spawn("train", *SLOW, "--out", out, "--overwrite")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _partials(tmp_path) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.poll() is None, "the overwriting run finished before the test could race it"
        holder = f"in use by pid {process.pid} (fedaudit train --overwrite)"
        assert holder in assert_user_error(invoke("train", *SLOW, "--out", out, "--overwrite"))
        assert holder in assert_user_error(invoke("attack", out, "--no-progress"))
        assert holder in assert_user_error(invoke("train", "--resume", out, "--no-progress"))
        assert process.wait(timeout=TIMEOUT) == 0
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
