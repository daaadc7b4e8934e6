"""The README's demo table is what `make demo` prints: the demo's commands (read from the Makefile, so that the two
cannot drift apart) are run as they stand, and every figure of the README's table is recomputed from the runs."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedaudit.reports.collect import collect_runs
from fedaudit.reports.summary import fmt, interval

ROOT = Path(__file__).resolve().parents[2]
ROWS = {"FedAvg (no DP)": "fedavg", "DP-FedAvg": "dp-fedavg"}


def _readme_rows() -> dict[str, list[str]]:
    """The demo table of the README, by its first cell."""
    text = (ROOT / "README.md").read_text()
    section = text.split("### What the demo shows", 1)[1].split("\n\n", 2)[1]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells[0] in ROWS:
            rows[cells[0]] = cells[1:]
    return rows


def _demo_commands(run: Path) -> list[str]:
    """The commands `make demo` runs, with this interpreter's virtual environment and ``run`` as its output."""
    venv = Path(sys.executable).parent.parent
    listing = subprocess.run(
        ["make", "-s", "-n", "demo", f"RUN={run}", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    commands = [line for line in listing.splitlines() if re.search(r"/fedaudit (train|attack|report) ", line)]
    assert len(commands) == 4, listing
    return commands


@pytest.mark.skipif(shutil.which("make") is None, reason="the demo is defined in the Makefile")
def test_the_readme_demo_table_is_what_the_demo_computes(tmp_path):
    commands = _demo_commands(tmp_path / "demo")
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{shlex.split(command)[:3]}: {done.stderr[-2000:]}"
    readme = _readme_rows()
    assert set(readme) == set(ROWS), "the README's demo table lost a row"
    runs = {run.name: run for run in collect_runs([tmp_path / "demo" / name for name in ROWS.values()])}
    for label, name in ROWS.items():
        run = runs[name]
        attacks = {a.signal: a for a in run.final_attacks}
        bounds = run.corrected_bounds()
        simultaneous, _ = run.epsilon_lower_bound()
        epsilon = f"{fmt(run.privacy.epsilon)} (delta {run.privacy.delta:g})" if run.privacy.dp else "no DP"
        expected = [
            f"{fmt(run.final_accuracy)} {interval(run.final_accuracy_ci)}",
            epsilon,
            f"{fmt(attacks['loss'].auc)} {interval(attacks['loss'].auc_ci)}",
            f"{fmt(attacks['grad-norm'].auc)} {interval(attacks['grad-norm'].auc_ci)}",
            ", ".join(
                [fmt(attacks["loss"].epsilon_lower_bound), fmt(attacks["grad-norm"].epsilon_lower_bound)]
                + [fmt(simultaneous)]
            ),
        ]
        assert readme[label] == expected, f"README demo row {label!r} is stale"
        assert len(bounds) == 2
    report = (tmp_path / "demo" / "report" / "report.md").read_text()
    plain, dp = report.split("## Run fedavg", 1)[1].split("## Run dp-fedavg", 1)
    sentence = next(line for line in plain.splitlines() if line.startswith("Strongest of the 2 attacks"))
    assert f"simultaneous over the 2 final-model attacks: {fmt(runs['fedavg'].epsilon_lower_bound()[0])}" in sentence
    assert "1 - 0.05/2" in sentence and "for that attack alone" in sentence and "against the accountant" not in sentence
    sentence = next(line for line in dp.splitlines() if line.startswith("Strongest of the 2 attacks"))
    assert "lower bound, simultaneous over the 2 final-model attacks: 0 against" in sentence
    assert "better than chance" not in sentence or "though no single threshold" in sentence
