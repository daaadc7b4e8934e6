"""Every script under benchmarks/ runs end to end with ``--smoke`` (the smallest sizes) and prints its table, below a
line naming the device, cores, torch version and threads its figures come from.

Each script runs as its own process from an empty working directory, with ``--out`` inside it where the script has
that option, so that a smoke run leaves nothing in the repository. The process is forked from a zygote that imported
torch and fedaudit once (tests/support/zygote.py) and runs the script as ``python SCRIPT`` would; a script that starts
``fedaudit`` commands is given the zygote's ``fedaudit`` (``--fedaudit``), whose commands are forked from it too.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from zygote import Zygote

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("*.py") if not p.name.startswith("_"))  # _name.py: shared code

# Each script's table: text its header line holds, and a pattern (re.MULTILINE) one of the lines after it matches.
# A new script needs an entry here.
TABLES: dict[str, tuple[str, str]] = {
    "accounting.py": ("previous/ours", r"^\s+0\.7\s+0\.01\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\s+\d\.\de-\d+$"),
    "attack_signals.py": ("previous/ours", r"^\s+8\s+\d"),
    "attack_strength.py": ("attacks on the final model", r"^\s+RMIA offline, K=1\s+AUC \d"),
    "audit_power.py": ("verify (s)", r"^digits\s+fedavg\s+gradient\s+\S+\s+\d"),
    "client_canaries.py": ("estimate/eps", r"^\s+0\.1\s+2\s+1\s+\d+\.\d\s+\d+\.\d\d\s+\d+\.\d\d\s"),
    "bootstrap.py": ("previous/ours", r"^\s+100\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\d\s+\[0\.\d{3}, 0\.\d{3}\]"),
    "canary_directions.py": ("previous/ours", r"^\s+8\s+\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+True$"),
    "demo_spread.py": ("spread", r"^dp-fedavg\s+accuracy\s+\d"),
    "dp_step.py": ("ours/plain", r"^\s+8(\s+\d+\.\d\d){5}(\s+-?\d+\.\d\d){2}\s+\d+\.\d{3}$"),
    "dp_price.py": ("DP/no DP", r"^\s+8\s+1\s+\d+\.\d\s+\d+\.\d\s+\d+\.\d\d\s+\d+\.\d\d-\d+\.\d\d$"),
    "engine_overhead.py": ("s_per_round", r"^digits dp-fedavg\s+local\s+\d"),
    "fault_detection.py": ("probe", r"^noise replaced by zeros\s+1\s+1\.00"),
    "fedlap_round.py": ("FedLAP-DP (s)", r"^\s+8\s+\d+\s+\d"),
    "flower_canaries.py": ("bound/eps", r"^every client\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+\.\d+"),
    "first_layer.py": ("all grouped", r"^\s+8\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d\s+\d+\.\d\d$"),
    "generator.py": ("generated-trained acc", r"^digits \| 100 \| no DP \|"),
    "integrity.py": ("reference", r"^commit one round"),
    "leakage.py": ("AUC 95% interval", r"^\s*fedavg-nodp-seed0\s+1\s"),
    "noise_sources.py": ("secret/previous", r"^\s+8\s+16\s+\d+\s+\d"),
    "own_data.py": ("load_dataset", r"^folder: 100 PNG"),
    "per_client_intervals.py": ("per client (s)", r"^\s+20\s+\d"),
    "per_sample_grads.py": ("GSM/ours", r"^\s+8\s+\d"),
    "pooling.py": ("plain previous/ours", r"^\s+8\s+8\s+\d+\.\d\d\s+\d+\.\d\d\s"),
    "query_recording.py": ("median (s)", r"^with recording\s+\d"),
    "reconstruction.py": ("null PSNR dB", r"^digits\s+fedsgd\s+1\s+1\s+2\s+none\s+-\s+2\s+\d+\.\d+ \["),
    "scale.py": ("peak RSS (MB)", r"^\s+20\s+2\s+every 2, 100 records\s+\d"),
    "table2.py": ("FedLAP-DP acc %", r"^\s+\d+\.\d\d\s+2\s+\d+\.\d\d\s+\d+\.\d\d \+- \d+\.\d\d\s+\d+\.\d\d \+- "),
    "twins.py": ("max rel. diff", r"^\s+8\s+\d+\s+8\s"),
    "units.py": ("accuracy", r"^\s+client\s+8\s+\d+\.\d\s+\d\.\d{3}$"),
    "utility.py": ("DP-FedAvg acc %", r"^1\s+\d"),
}


def test_every_script_has_a_table() -> None:
    """A new benchmark script is smoke-tested only once its table is described in TABLES."""
    assert SCRIPTS
    assert {script.name for script in SCRIPTS} == set(TABLES)


# What most scripts import before they work; each script imports the rest itself.
IMPORTS = ["torch", "numpy", "pandas", "fedaudit.training", "fedaudit.attacks.runner", "fedaudit.preparation"]


@pytest.fixture(scope="module")
def scripts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    """A zygote whose programs are the scripts (each its own entry), stopped by its pid after the module's tests."""
    programs = {**{str(s): str(s) for s in SCRIPTS}, "fedaudit": "fedaudit.cli:main"}
    zygote = Zygote(tmp_path_factory.mktemp("scripts"), programs, IMPORTS)
    try:
        yield zygote
    finally:
        zygote.close()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda script: script.name)
def test_smoke(script: Path, tmp_path: Path, scripts: Zygote) -> None:
    """``python SCRIPT --smoke`` exits 0, prints its table, and writes only into --out under the working directory."""
    assert script.name in TABLES, f"describe the table of {script.name} in TABLES"
    header, row = TABLES[script.name]
    args = ["--smoke"]
    source = script.read_text()
    if re.search(r'add_argument\(\s*"--out"', source):
        args += ["--out", str(tmp_path / "out")]
    if "add_program_option(parser)" in source:  # the fedaudit commands it starts fork from the zygote too
        args += ["--fedaudit", str(scripts.bin / "fedaudit")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    logs = tmp_path.parent / f"{tmp_path.name}-output"
    logs.mkdir()
    profile = logs / "profile.txt"
    if script.name == "fedlap_round.py":  # its profiler too, whose tables go beside the logs
        args += ["--profile", str(profile)]
    out, err = logs / "stdout", logs / "stderr"
    process = scripts.start(str(script), args, cwd=tmp_path, env=env, stdout=out, stderr=err)
    try:
        code = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    stdout, stderr = out.read_text(), err.read_text()
    assert code == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    lines = stdout.splitlines()
    at = next((i for i, line in enumerate(lines) if header in line), None)
    assert at is not None, f"no header line with {header!r}:\n{stdout}"
    assert re.search(r"^device: .+; \d+ CPU cores; torch \S+, \d+ torch thread", stdout, re.MULTILINE), (
        f"no line naming the device the figures were measured on:\n{stdout}"
    )
    assert re.search(row, "\n".join(lines[at + 1 :]), re.MULTILINE), f"no row matching {row!r}:\n{stdout}"
    assert {p.name for p in tmp_path.iterdir()} <= {"out"}, "wrote into the working directory"
    if script.name == "fedlap_round.py":
        assert "% busy" in stdout and "Self CPU time total" in profile.read_text()
