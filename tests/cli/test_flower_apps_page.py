"""docs/flower-apps.md's walk-through, run as a user runs it: the app is the page's Python block, saved under the
name the page gives it, and the commands are the page's shell blocks, in order, in a fresh folder (the installation
line excepted: this environment is the installation). The page and this test cannot drift apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "flower-apps.md"


def walkthrough() -> tuple[str, str, list[str]]:
    """The app's file name and code, and the commands, from the page's walk-through section."""
    section = PAGE.read_text(encoding="utf-8").split("## Walk-through", 1)[1].split("\n## ", 1)[0]
    name = re.search(r"Save this as `([\w.]+)`", section)
    assert name, "the walk-through names the file the app is saved as"
    fenced = re.findall(r"^```(\w+)\n(.*?)^```", section, flags=re.MULTILINE | re.DOTALL)
    code = [body for language, body in fenced if language == "python"]
    assert len(code) == 1, "one Python block: the app"
    commands = [line for language, body in fenced if language == "bash" for line in body.splitlines() if line.strip()]
    return name.group(1), code[0], commands


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    name, code, commands = walkthrough()
    assert commands[0] == "pip install 'fedaudit[flower]'"
    assert commands[1:] == [f"python {name}", "fedaudit attack --flower-log canaries.npz", "ls canaries-audit"]
    (tmp_path / name).write_text(code, encoding="utf-8")
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "OMP_NUM_THREADS": "1",
        "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    }
    outputs = []
    for command in commands[1:]:
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        outputs.append(done.stdout)
    table = outputs[1]
    for line in (
        "all-iterates",
        "final-model",
        "accountant (rdp, client-level",
        "Flower 1.",
        "Results: canaries-audit",
    ):
        assert line in table, table
    assert outputs[2].split() == ["metrics.json", "roc.csv", "scores.csv"]
    assert "not above the accountant's epsilon" in table  # a correct app
