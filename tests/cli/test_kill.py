"""Real processes: ``fedaudit train``, ``attack``, ``report`` and ``compare`` killed with SIGKILL at several moments,
then the same command again (or ``--resume``), must end like an uninterrupted command (byte for byte, up to times and
paths) with no stray file; and a second writer of a run that another process is training is refused with the
holder's pid. Every process a test starts is killed by its pid in a ``finally``; each is forked from the session's
zygote of fedaudit (its imports done once) and is a process of its own, with its own pid."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import yaml
from helpers import FAST_ARGS, assert_user_error, invoke, pango
from zygote import Forked, Zygote

from fedaudit.reports.render import PARTIAL
from fedaudit.rundir import RunDirectory
from fedaudit.rundir.integrity import LOCK

SLOW = (*FAST_ARGS, "--rounds", "4", "--local-epochs", "4")  # long enough to be caught in its rounds
TIMEOUT = 120


Spawn = Callable[..., Forked]


@pytest.fixture
def spawn(fedaudit_zygote: Zygote) -> Spawn:
    """``spawn(*args)``: ``fedaudit ARGS`` as a process of its own, its output discarded, forked from the session's
    zygote (which imported fedaudit once: each start would otherwise import torch again); its pid is its own."""

    def start(*args: str | Path) -> Forked:
        return fedaudit_zygote.start("fedaudit", [str(a) for a in args], env={**os.environ, "OMP_NUM_THREADS": "1"})

    return start


def kill_when(process: Forked, ready: Callable[[], bool]) -> bool:
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
def test_kill_9_at_any_moment_then_the_same_command_again_gives_the_same_run(reference, tmp_path, moment, spawn):
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
        assert RunDirectory(out).seal.problems() == []
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
    assert RunDirectory(out).seal.problems() == []


def test_a_run_being_trained_refuses_a_second_writer_naming_its_pid(reference, tmp_path, spawn):
    out = tmp_path / "run"
    assert invoke("train", *SLOW, "--rounds", "1", "--out", out).exit_code == 0
    process = spawn("train", *SLOW, "--out", out, "--overwrite")
    try:
        deadline = time.monotonic() + TIMEOUT
        while not _partials(tmp_path) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process.poll() is None, "the overwriting run finished before the test could race it"
        # the old run is held as "fedaudit train --overwrite" until the new one replaces it, then as "fedaudit train"
        holder = re.compile(rf"in use by pid {process.pid} \(fedaudit train( --overwrite)?\)")
        assert holder.search(assert_user_error(invoke("train", *SLOW, "--out", out, "--overwrite")))
        assert holder.search(assert_user_error(invoke("attack", out, "--no-progress")))
        assert holder.search(assert_user_error(invoke("train", "--resume", out, "--no-progress")))
        assert process.wait(timeout=TIMEOUT) == 0
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
    assert (out / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------------------- attack, report and compare

_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(\+00:00|Z)?")
_VOLATILE = {"manifest.json", LOCK}  # hashes of files that hold times, and the lock's holder: checked otherwise


def _pending(run: Path) -> bool:
    """A commit of ``run`` is under way: its manifest lists the hashes of files not written yet."""
    try:
        return bool(json.loads((run / "manifest.json").read_text()).get("pending"))
    except (OSError, ValueError):
        return False


def normalised(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative name, with what may differ between two equal computations taken out:
    the folder's own path, times, and metrics.csv's wall-clock seconds. Locks and manifests are left out (their
    integrity is checked apart)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name in _VOLATILE:
            continue
        name = str(path.relative_to(folder))
        if path.suffix in (".safetensors", ".npz", ".png", ".pdf"):
            found[name] = path.read_bytes().hex()
            continue
        text = _TIME.sub("<TIME>", path.read_text(encoding="utf-8").replace(str(folder), "<OUT>"))
        if path.name == "metrics.csv":
            text = pd.read_csv(io.StringIO(text)).drop(columns="wall_seconds").to_csv(index=False)
        found[name] = text
    return found


def assert_same_tree(done: Path, reference: Path) -> None:
    """``done`` holds exactly the files of ``reference`` with the same contents, and every run in it checks."""
    ours, theirs = normalised(done), normalised(reference)
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name] == theirs[name], name
    for manifest in done.rglob("manifest.json"):
        assert RunDirectory(manifest.parent).seal.problems() == [], manifest.parent


def killed_then_again(
    spawn: Spawn,
    tmp_path: Path,
    args: tuple[str | Path, ...],
    ready: Callable[[], bool],
    moment: str,
    *,
    again: Callable[[], None] | None = None,
) -> None:
    """Start ``fedaudit ARGS``, SIGKILL it when ``ready()`` holds, then give the same command again in-process.
    A command that finished before the moment is started again, twice at most, after ``again()`` has cleared what
    it wrote (when given): a short moment (an attack's commit inside a study) is missed now and then."""
    tries = 1 if again is None else 3
    for attempt in range(tries):
        process = spawn(*args)
        try:
            hit = kill_when(process, ready)
        finally:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
        if hit:
            break
        if again is None or attempt == tries - 1:
            pytest.skip(f"the command finished before {moment}")
        again()
    result = invoke(*args)
    assert result.exit_code == 0, result.output


ATTACK = ("--target", "all", "--signal", "loss", "--signal", "grad-norm", "--method", "threshold")
ATTACK += ("--max-records", "200", "--bootstrap", "200", "--no-progress")


@pytest.fixture(scope="module")
def attacked(reference, tmp_path_factory) -> Path:
    """The reference run attacked without interruption, in a folder of its own."""
    run = tmp_path_factory.mktemp("attacked") / "run"
    shutil.copytree(reference, run)
    assert invoke("attack", run, *ATTACK).exit_code == 0
    return run


ATTACK_MOMENTS: dict[str, Callable[[Path], bool]] = {
    "a result's commit under way": lambda run: _pending(run) and (run / "attacks").is_dir(),
    "two results committed": lambda run: len(list(run.glob("attacks/*/metrics.json"))) >= 2,
}


@pytest.mark.parametrize("moment", list(ATTACK_MOMENTS))
def test_attack_killed_at_any_moment_then_given_again_writes_the_same_results(
    attacked, reference, tmp_path, moment, spawn
):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    killed_then_again(spawn, tmp_path, ("attack", run, *ATTACK), lambda: ATTACK_MOMENTS[moment](run), moment)
    assert_same_tree(run.parent, attacked.parent)


def test_report_killed_while_writing_then_given_again_writes_the_same_report(attacked, tmp_path, spawn):
    pango()  # the report has a PDF
    reports = tmp_path / "reports"
    args = ("report", attacked, "--out", reports / "out", "--format", "html", "--format", "md", "--format", "pdf")
    assert invoke(*args[:3], reports / "reference", *args[4:]).exit_code == 0
    killed_then_again(spawn, tmp_path, args, lambda: (reports / "out" / PARTIAL).exists(), "the report's marker")
    ours, theirs = normalised(reports / "out"), normalised(reports / "reference")
    assert sorted(ours) == sorted(theirs)
    for name in ("report.md", "summary.csv", "groups.csv", "summary.json"):
        assert ours[name].replace("<OUT>", "") == theirs[name].replace("<OUT>", ""), name


STUDY = {
    "algorithms": ["fedavg"],
    "budgets": ["epsilon:20", "none"],
    "seeds": [0],
    "base": {
        "data": {"dataset": "digits"},
        "model": {"arch": "mlp", "width": 16, "depth": 1},
        "federated": {"rounds": 3, "batch_size": 32},
        "privacy": {"noise_seed": 0},  # reproducible noise: the killed study's process must train the same runs
        "device": "cpu",
    },
    "attack": {"signals": ["loss"], "methods": ["threshold"], "max_records": 200, "bootstrap": 50},
    "report": {"formats": ["html", "md"]},
}
STUDY_MOMENTS: dict[str, Callable[[Path], bool]] = {
    "a run being trained": lambda out: any(_rounds_done(run) >= 1 for run in out.glob("runs/*")),
    "an attack being written": lambda out: any(
        _pending(run) and (run / "attacks").is_dir() for run in out.glob("runs/*")
    ),
    "the report being written": lambda out: (out / PARTIAL).exists(),
}


@pytest.fixture(scope="module")
def studied(tmp_path_factory) -> tuple[Path, Path]:
    """The study file and its directory after one uninterrupted `fedaudit compare`."""
    folder = tmp_path_factory.mktemp("studied")
    (folder / "study.yaml").write_text(yaml.safe_dump(STUDY))
    assert invoke("compare", "--study", folder / "study.yaml", "--out", folder / "out", "--no-progress").exit_code == 0
    return folder / "study.yaml", folder / "out"


@pytest.mark.parametrize("moment", list(STUDY_MOMENTS))
def test_compare_killed_at_any_moment_then_given_again_ends_as_an_uninterrupted_study(studied, tmp_path, moment, spawn):
    study, reference = studied
    out = tmp_path / "out"
    args = ("compare", "--study", study, "--out", out, "--no-progress")
    killed_then_again(
        spawn, tmp_path, args, lambda: STUDY_MOMENTS[moment](out), moment, again=lambda: shutil.rmtree(out)
    )
    assert_same_tree(out, reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_compare_killed_between_an_attacks_last_result_and_its_manifest_commits_the_results_when_given_again(
    studied, tmp_path
):
    """The moment a timed kill rarely hits: every result written, so the study finds the results current and does not
    attack again, but the commit still pending and a half-written manifest beside it (CI caught it once). Given
    again, compare commits the results as they are and clears the leftover."""
    study, reference = studied
    out = tmp_path / "out"
    assert invoke("compare", "--study", study, "--out", out, "--no-progress").exit_code == 0
    run = sorted(out.glob("runs/*"))[-1]
    manifest = json.loads((run / "manifest.json").read_text())
    results = {name: digest for name, digest in manifest["files"].items() if name.startswith("attacks/")}
    assert results
    manifest["files"] = {name: digest for name, digest in manifest["files"].items() if name not in results}
    manifest["pending"] = results
    (run / "manifest.json").write_text(json.dumps(manifest, indent=2))
    (run / ".manifest.json.k1ll3d00.tmp").write_text('{"format": ')
    assert invoke("compare", "--study", study, "--out", out, "--no-progress").exit_code == 0
    assert not list(out.rglob("*.tmp"))
    settled = json.loads((run / "manifest.json").read_text())
    assert "pending" not in settled and all(settled["files"][name] == digest for name, digest in results.items())
    assert_same_tree(out, reference)
