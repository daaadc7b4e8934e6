"""What a person meets at the command line: quick help, one-sentence usage errors, readable files, clean resumes,
quiet logs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import FAST_ARGS, assert_user_error, tree_digest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["train", "--help"],
        ["attack", "--help"],
        ["report", "--help"],
        ["compare", "--help"],
        ["train", "--algorithm", "fedfoo"],
    ],
)
def test_help_and_usage_errors_do_not_load_torch(args):
    """torch takes seconds to import: the CLI must answer --help and usage errors before loading it."""
    probe = (
        "import sys\nfrom click.testing import CliRunner\nfrom fedaudit.cli import main\n"
        f"result = CliRunner().invoke(main, {args!r})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint(result.exit_code)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("2" if "fedfoo" in args else "0")


def test_help_texts_are_whole():
    """Every command's first sentence in full, every option of `epsilon` explained, every policy key named."""
    from click.testing import CliRunner

    from fedaudit.cli import main
    from fedaudit.reports.policy import LIMITS

    runner = CliRunner()
    top = runner.invoke(main, ["--help"]).output
    assert "..." not in top.split("Commands:")[1] and "does what it charges for." in " ".join(top.split())
    epsilon = runner.invoke(main, ["epsilon", "--help"]).output
    assert "delta of (epsilon, delta)-DP" in epsilon
    report = " ".join(runner.invoke(main, ["report", "--help"]).output.split())
    assert all(key in report for key in LIMITS), [key for key in LIMITS if key not in report]


def test_target_epsilon_prints_the_noise_multiplier_it_chose(tmp_path):
    from helpers import invoke

    result = invoke("train", *FAST_ARGS, "--dp", "--rounds", "1", "--target-epsilon", "4", "--out", tmp_path / "r")
    assert result.exit_code == 0, result.output
    assert "calibrated for --target-epsilon 4 over the rounds each client takes part in" in result.output


@pytest.mark.parametrize(
    "args, sentence",
    [
        (
            ["train", "--algorithm", "fedfoo", "--out", "x"],
            "Error: Invalid value for '--algorithm': 'fedfoo' is not one of 'fedavg', 'fedprox', 'fedsgd', "
            "'scaffold', 'fedssyn', 'fedlap', 'fedgm', 'feddm'.",
        ),
        (
            ["epsilon", "--steps", "0", "--sample-rate", "0.1", "--rounds", "3", "--noise-multiplier", "1"],
            "Error: Invalid value for '--steps': 0 is not in the range x>=1.",
        ),
        (
            ["epsilon", "--steps", "10", "--sample-rate", "1.5", "--rounds", "3", "--noise-multiplier", "1"],
            "Error: Invalid value for '--sample-rate': 1.5 is not in the range 0<x<=1.",
        ),
        (["attack", "--xyzzy", "run"], "Error: No such option '--xyzzy'."),
        (["report", "run"], "Error: Missing option '--out'."),
    ],
)
def test_usage_errors_are_one_sentence_with_the_option_the_user_typed(cli, tmp_path, args, sentence):
    result = cli(*args)
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [sentence]
    assert not (tmp_path / "x").exists()


def test_files_are_written_with_the_process_umask(tmp_path, cli):
    old = os.umask(0o022)
    try:
        result = cli("train", *FAST_ARGS, "--rounds", "1", "--out", tmp_path / "run")
        assert result.exit_code == 0, result.output
        attacked = cli("attack", tmp_path / "run", "--signal", "loss", "--method", "threshold", "--bootstrap", "40")
        assert attacked.exit_code == 0, attacked.output
        os.umask(0o027)
        assert cli("report", tmp_path / "run", "--out", tmp_path / "report.md").exit_code == 0
    finally:
        os.umask(old)
    run_files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert run_files and {stat.S_IMODE(p.stat().st_mode) for p in run_files} == {0o644}
    assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o640


def test_resume_removes_temporary_files_left_by_a_kill(tmp_path, plain_run, cli):
    out = tmp_path / "run"
    shutil.copytree(plain_run, out)
    before = tree_digest(out)
    stale = [out / ".model.safetensors.k1ll3d_x.tmp", out / "checkpoints" / ".round-0003.safetensors.x9abcdef.tmp"]
    kept = [out / "attacks" / "loss-threshold" / ".scores.csv.a1b2c3d4.tmp"]
    for path in stale + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half a file")
    (out / ".notes.tmp").write_text("not a temporary of fedaudit's, nor a file the run wrote")
    assert_user_error(cli("train", "--resume", out, "--no-progress"), mentions=".notes.tmp was not written by fedaudit")
    (out / ".notes.tmp").unlink()
    result = cli("train", "--resume", out, "--no-progress")
    assert result.exit_code == 0, result.output
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)  # not a temporary of training's: not training's to remove
    for path in kept:
        path.unlink()
    shutil.rmtree(out / "attacks")
    after = tree_digest(out)
    del before["manifest.json"], after["manifest.json"]  # its "updated" time stamp moves
    assert after == before


def test_progress_bars_stay_out_of_logs(tmp_path, cli):
    """Output that is not a terminal (a log, a pipe, CliRunner) gets the round summaries, not bar frames."""
    args = [a for a in FAST_ARGS if a != "--no-progress"]
    result = cli("train", *args, "--rounds", "2", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    assert "\r" not in result.output
    assert [line for line in result.output.splitlines() if "round 2/2" in line]


def test_a_long_round_says_up_front_how_long_it_will_take(tmp_path, cli, monkeypatch):
    """After the first client, a run whose rounds take minutes says how long the rest will take (here the threshold
    is lowered so that a quick run crosses it)."""
    from fedaudit.engine import local

    monkeypatch.setattr(local, "ESTIMATE_FROM_SECONDS", 0.0)
    result = cli("train", *FAST_ARGS, "--rounds", "2", "--out", tmp_path / "run")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "the first client took" in line]
    assert len(lines) == 1 and lines[0].startswith("round 1/2:") and "the 2 round(s) to go about" in lines[0]
    assert result.output.index("the first client took") < result.output.index("round 1/2: test accuracy")


def test_durations_read_as_words():
    from fedaudit.engine.local import duration

    assert [duration(s) for s in (4.2, 89, 700, 9000)] == ["4 s", "89 s", "12 min", "2.5 h"]
