"""The README's demo table is what `make demo` prints: the demo's commands (read from the Makefile, so that the two
cannot drift apart) are run as they stand, and every figure of the README's table is recomputed from the runs. The
demo's HTML report, laid out by a real browser (headless Chromium), opens with the verdict and the privacy guarantee,
above the first table of results."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CHROMIUM_FLAGS, binary
from PIL import Image
from zygote import Zygote

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


def _demo_commands(run: Path, venv: Path | None = None) -> list[str]:
    """The commands `make demo` runs, with ``run`` as its output and ``venv/bin/fedaudit`` as the program: this
    interpreter's virtual environment's, or the session zygote's shim (a `fedaudit` process forked from a zygote that
    imported fedaudit once: tests/support/zygote.py)."""
    venv = venv or Path(sys.executable).parent.parent
    listing = subprocess.run(
        ["make", "-s", "-n", "demo", f"RUN={run}", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    commands = [line for line in listing.splitlines() if re.search(r"/fedaudit (train|attack|report) ", line)]
    assert len(commands) == 4, listing
    return commands


@pytest.fixture(scope="module")
def demo(tmp_path_factory, fedaudit_zygote: Zygote) -> Path:
    """The demo's runs and report, made by the Makefile's own commands."""
    if shutil.which("make") is None:
        pytest.skip("the demo is defined in the Makefile")
    out = tmp_path_factory.mktemp("demo") / "demo"
    for command in _demo_commands(out, fedaudit_zygote.bin.parent):
        done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, f"{shlex.split(command)[:3]}: {done.stderr[-2000:]}"
    return out


# How far each figure of the demo may lie from the README's, by run and kind of figure, from what
# benchmarks/demo_spread.py measured (docs/measured-figures.md). FedAvg without DP is deterministic on one CPU, but
# MKL and oneDNN pick their kernels per CPU: across kernel settings and CPUs its accuracy did not move, its AUCs and
# their intervals moved by at most 0.004, and its epsilon lower bounds (a threshold chosen on half of the records) by
# up to 0.46. DP-FedAvg draws its noise from fresh client secrets in every run: over 30 runs its accuracy ranged
# 0.661 to 0.817 and its AUCs 0.516 to 0.597 (standard deviations about 0.04 and 0.015; the bands are 3.75 of them),
# and an attack's bound rose above 0 in 2 of them (0.120 at most; 0.128 in a CI run): the band is 0.2.
TOLERANCE = {
    "FedAvg (no DP)": {"accuracy": 0.005, "auc": 0.01, "bound": 0.5},
    "DP-FedAvg": {"accuracy": 0.15, "auc": 0.06, "bound": 0.2},
}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _figures(run) -> list[str]:
    """A run's row as the README writes it."""
    attacks = {a.signal: a for a in run.final_attacks}
    simultaneous, _ = run.epsilon_lower_bound()
    epsilon = f"{fmt(run.privacy.epsilon)} (delta {run.privacy.delta:g})" if run.privacy.dp else "no DP"
    return [
        f"{fmt(run.final_accuracy)} {interval(run.final_accuracy_ci)}",
        epsilon,
        f"{fmt(attacks['loss'].auc)} {interval(attacks['loss'].auc_ci)}",
        f"{fmt(attacks['grad-norm'].auc)} {interval(attacks['grad-norm'].auc_ci)}",
        ", ".join([fmt(attacks["loss"].epsilon_lower_bound), fmt(attacks["grad-norm"].epsilon_lower_bound)])
        + f", {fmt(simultaneous)}",
    ]


def _stale(label: str, readme: list[str], computed: list[str]) -> list[str]:
    """Where a README row and a run's figures differ by more than the spread the row allows, or in a verdict: the
    non-DP model's AUC intervals lie above 0.5 and its bounds are positive; no attack's bound on the DP model reaches
    the accountant's epsilon (whether a bound on the DP model is 0 or a little above is its fresh noise's draw)."""
    kinds = ("accuracy", None, "auc", "auc", "bound")
    problems = []
    for kind, ours, theirs in zip(kinds, readme, computed):
        if kind is None:
            if ours != theirs:
                problems.append(f"{ours!r} is {theirs!r}")
            continue
        a, b = [float(x) for x in NUMBER.findall(ours)], [float(x) for x in NUMBER.findall(theirs)]
        if len(a) != len(b) or any(abs(x - y) > TOLERANCE[label][kind] + 1e-9 for x, y in zip(a, b)):
            problems.append(f"{ours!r} is {theirs!r}, more than {TOLERANCE[label][kind]} apart")
    auc_lows = [float(NUMBER.findall(cell)[1]) for cell in computed[2:4]]
    bounds = [float(x) for x in NUMBER.findall(computed[4])]
    if label == "FedAvg (no DP)" and not (min(auc_lows) > 0.5 and min(bounds) > 0):
        problems.append(f"the model without DP no longer shows its leakage: {computed[2:]}")
    if label == "DP-FedAvg" and max(bounds) >= float(NUMBER.findall(computed[1])[0]):
        problems.append(f"an attack's bound on the DP model reaches its epsilon: {computed[4]} against {computed[1]}")
    return problems


def test_the_readme_demo_table_is_what_the_demo_computes(demo):
    readme = _readme_rows()
    assert set(readme) == set(ROWS), "the README's demo table lost a row"
    runs = {run.name: run for run in collect_runs([demo / name for name in ROWS.values()])}
    for label, name in ROWS.items():
        problems = _stale(label, readme[label], _figures(runs[name]))
        assert not problems, f"README demo row {label!r} is stale: {problems}"
        assert len(runs[name].corrected_bounds()) == 2
    report = (demo / "report" / "report.md").read_text()
    plain, dp = report.split("## Run fedavg", 1)[1].split("## Run dp-fedavg", 1)
    sentence = next(line for line in plain.splitlines() if line.startswith("Strongest of the 2 attacks"))
    assert f"simultaneous over the 2 final-model attacks: {fmt(runs['fedavg'].epsilon_lower_bound()[0])}" in sentence
    assert "1 - 0.05/2" in sentence and "for that attack alone" in sentence and "against the accountant" not in sentence
    sentence = next(line for line in dp.splitlines() if line.startswith("Strongest of the 2 attacks"))
    simultaneous = fmt(runs["dp-fedavg"].epsilon_lower_bound()[0])
    assert f"lower bound, simultaneous over the 2 final-model attacks: {simultaneous} against" in sentence
    assert "better than chance" not in sentence or "though no single threshold" in sentence


# Measures, in the laid-out page, where the verdict, the guarantee and the first table after them begin and end,
# and writes it into the title, which --dump-dom prints. Added to a copy: the report itself carries no script.
_MEASURE = """<script>
const box = (element) => { const r = element.getBoundingClientRect(); return [r.top, r.bottom]; };
const verdict = document.getElementById("verdict"), guarantee = document.getElementById("guarantee");
const first = [...document.querySelectorAll("table")].find((t) => !verdict.contains(t) && !guarantee.contains(t));
document.title = JSON.stringify({verdict: box(verdict), guarantee: box(guarantee), table: box(first),
  heading: first.closest("section, body").querySelector("h2").textContent});
</script>"""
HEIGHT = 1800  # the screenshot: one tall screen of a laptop's browser at 1280 px width


def test_the_demo_report_opens_with_the_verdict_and_the_guarantee_above_the_first_table(demo, tmp_path):
    chromium = binary("chromium")
    html = (demo / "report" / "report.html").read_text(encoding="utf-8")
    assert "<script" not in html
    probe = tmp_path / "probe.html"
    probe.write_text(html.replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
    common = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--window-size=1280,{HEIGHT}"]
    dom = subprocess.run(
        [*common, "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dom.returncode == 0, dom.stderr[-2000:]
    title = re.search(r"<title>(.*?)</title>", dom.stdout, re.DOTALL)
    assert title is not None, dom.stdout[:2000]
    layout = json.loads(title.group(1).replace("&quot;", '"'))
    (v_top, v_bottom), (g_top, g_bottom), (t_top, _) = layout["verdict"], layout["guarantee"], layout["table"]
    assert 0 <= v_top < v_bottom <= g_top < g_bottom <= t_top, layout
    assert g_bottom <= HEIGHT, f"the guarantee ends at {g_bottom:.0f} px, below the first screen ({HEIGHT} px)"
    assert layout["heading"] != "Privacy guarantee"
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [*common, f"--screenshot={shot}", (demo / "report" / "report.html").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, HEIGHT)
    top = image.crop((0, int(v_top), 1280, int(g_bottom))).getcolors(1 << 20)
    assert top is not None and len(top) > 16  # text and tables were drawn there, not a blank page


def test_a_readme_or_a_demo_gone_stale_by_more_than_the_spread_fails(demo, tmp_path, fedaudit_zygote: Zygote):
    """The check has power: the README's accuracy moved by 0.02, or the run without DP trained for 5 rounds instead
    of the Makefile's 15, is caught; the DP model with a bound beyond its band, or one that reaches its epsilon, is
    caught."""
    readme = _readme_rows()
    (plain,) = collect_runs([demo / "fedavg"])
    row = _figures(plain)
    moved = [row[0].replace(row[0].split()[0], f"{float(row[0].split()[0]) + 0.02:.3f}", 1), *row[1:]]
    assert _stale("FedAvg (no DP)", moved, row)
    assert not _stale("DP-FedAvg", readme["DP-FedAvg"], [*readme["DP-FedAvg"][:4], "0.15, 0, 0.1"])
    assert _stale("DP-FedAvg", readme["DP-FedAvg"], [*readme["DP-FedAvg"][:4], "0.3, 0, 0.2"])
    small = [readme["DP-FedAvg"][0], "0.1 (delta 1e-05)", *readme["DP-FedAvg"][2:]]
    (problem,) = _stale("DP-FedAvg", small, [*small[:4], "0.15, 0, 0.1"])  # within the band, at its epsilon
    assert "reaches its epsilon" in problem
    out = tmp_path / "demo"
    commands = _demo_commands(out, fedaudit_zygote.bin.parent)
    train, attack = [c for c in commands if "--out" not in c or f"{out}/fedavg " in c][:2]
    short = train.replace("--rounds 15", "--rounds 5")
    assert short != train
    for command in (short, attack.replace(f" {out}/dp-fedavg", "")):
        done = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    (five,) = collect_runs([out / "fedavg"])
    assert _stale("FedAvg (no DP)", readme["FedAvg (no DP)"], _figures(five))
