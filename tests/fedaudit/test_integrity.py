"""Tamper evidence of a run directory: every file fedaudit wrote is hashed, every edit is caught and named, a ledger
whose numbers contradict its events or its configuration is caught even when the forger re-records the hashes, and
correct runs (complete, interrupted at any write, attacked, verified, extended) are never flagged.

The hashes the tests re-record (``rehash``) and the edits they make are written here with hashlib, sharing nothing
with fedaudit.rundir.integrity."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import FAST_ARGS, assert_user_error, invoke, read_json, rehash, tree_digest

import fedaudit.rundir.files as run_files
from fedaudit.rundir import RunDirectory
from fedaudit.rundir.integrity import LOCK as LOCK_NAME

# A DP-FedAvg canary run that keeps what crossed the wire: every kind of file a run writes.
FULL = ("--dp", "--rounds", "2", "--canaries", "200", "--save-transmitted")


@pytest.fixture(scope="module")
def full_run(trained) -> Path:
    return trained(*FULL)


def copy(run: Path, tmp_path: Path, name: str = "run") -> Path:
    return Path(shutil.copytree(run, tmp_path / name))


def written_files(run: Path) -> list[str]:
    """Every file of the run but the manifest, the lock and the clients' secrets, relative."""
    return sorted(
        p.relative_to(run).as_posix()
        for p in run.rglob("*")
        if p.is_file() and p.name not in ("manifest.json", ".fedaudit.lock", "client-secrets.json")
    )


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_correct_run_checks_and_records_every_file(full_run):
    manifest = read_json(full_run / "manifest.json")
    assert sorted(manifest["files"]) == written_files(full_run)
    assert "pending" not in manifest
    assert RunDirectory(full_run).seal.problems() == []
    kinds = {name.split("/")[0] for name in manifest["files"]}
    assert {"config.json", "privacy.json", "checkpoints", "transmitted", "queries", "canaries.npz"} <= kinds


@pytest.mark.parametrize("edit", ["flip", "append", "truncate", "delete"])
def test_every_file_edited_in_turn_is_caught_and_named(full_run, tmp_path, edit):
    run = copy(full_run, tmp_path)
    for name in written_files(full_run):
        path = run / name
        original = path.read_bytes()
        if edit == "flip":
            flip_middle_byte(path)
        elif edit == "append":
            path.write_bytes(original + b" ")
        elif edit == "truncate":
            path.write_bytes(original[: len(original) - 1])
        else:
            path.unlink()
        problems = RunDirectory(run).seal.problems()
        assert problems and problems[0].startswith(name), (name, problems)
        path.write_bytes(original)
    assert RunDirectory(run).seal.problems() == []


def test_an_added_file_is_caught(full_run, tmp_path):
    run = copy(full_run, tmp_path)
    forged = run / "attacks" / "loss-threshold" / "metrics.json"
    forged.parent.mkdir(parents=True)
    forged.write_text(json.dumps({"auc": 0.5}))
    assert RunDirectory(run).seal.problems() == [
        "attacks/loss-threshold/metrics.json was not written by fedaudit (manifest.json does not record it)"
    ]


def _edited_ledger(run: Path) -> None:
    """The issue's forgery: the last epsilon of the ledger lowered to 0.2, its events left as they were."""
    ledger = read_json(run / "privacy.json")
    ledger["epsilon_per_round"][-1] = 0.2
    (run / "privacy.json").write_text(json.dumps(ledger, indent=2))


def _edited_sigma(run: Path) -> None:
    config = read_json(run / "config.json")
    config["privacy"]["noise_multiplier"] = 0.3
    (run / "config.json").write_text(json.dumps(config, indent=2))


def _edited_client_epsilon(run: Path) -> None:
    ledger = read_json(run / "privacy.json")
    for entry in ledger["per_client"].values():
        entry["epsilon"] = entry["epsilon"] / 3
    (run / "privacy.json").write_text(json.dumps(ledger, indent=2))


@pytest.mark.parametrize(
    ("forge", "file", "what"),
    [
        (_edited_ledger, "privacy.json", "its own events give"),
        (_edited_sigma, "config.json", "config.json says 0.3"),
        (_edited_client_epsilon, "privacy.json", "its own events give"),
    ],
    ids=["epsilon-per-round", "config-sigma", "per-client-epsilon"],
)
@pytest.mark.parametrize("rehashed", [False, True], ids=["naive", "hashes-recorded"])
def test_a_forged_ledger_fails_the_report_and_is_not_resumed(dp_run, tmp_path, forge, file, what, rehashed):
    run = copy(dp_run, tmp_path)
    forge(run)
    if rehashed:
        rehash(run)
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_epsilon: 1000\n")
    report = invoke("report", run, "--out", tmp_path / "report", "--format", "md", "--policy", policy)
    assert report.exit_code == 1, report.output
    assert "Policy: FAIL" in report.output and "integrity FAIL" in report.output
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "Are the files those fedaudit wrote? **FAIL**" in markdown
    expected = what if rehashed else "was changed after fedaudit wrote it"
    assert expected in markdown
    before = tree_digest(run)
    line = assert_user_error(invoke("train", "--resume", run, "--no-progress"), mentions=expected)
    assert line.startswith(f"Error: Refusing to resume {run}: ")
    assert_user_error(invoke("attack", run, "--no-progress"), mentions=expected)
    assert tree_digest(run) == before
    if not rehashed:
        assert file in line


def test_without_a_policy_a_tampered_run_fails_the_report(dp_run, tmp_path):
    run = copy(dp_run, tmp_path)
    _edited_ledger(run)
    rehash(run)
    result = invoke("report", run, "--out", tmp_path / "out.md")
    assert result.exit_code == 1
    assert "FAIL: its files are not those fedaudit wrote: privacy.json says epsilon 0.2 after round 3" in result.output


def test_verify_fails_a_tampered_run_and_writes_nothing_into_it(full_run, tmp_path):
    run = copy(full_run, tmp_path)
    flip_middle_byte(run / "queries" / "round-0002.safetensors")
    before = tree_digest(run)
    result = invoke("verify", run)
    assert result.exit_code == 1
    assert "FAIL integrity: queries/round-0002.safetensors was changed after fedaudit wrote it" in result.output
    assert "conformance not checked" in result.output
    assert tree_digest(run) == before


def test_attacking_verifying_and_extending_a_run_keep_it_checked(full_run, tmp_path):
    run = copy(full_run, tmp_path)
    assert invoke("attack", run, "--no-progress").exit_code == 0
    assert invoke("verify", run).exit_code == 0
    assert invoke("train", "--resume", run, "--rounds", "3", "--no-progress").exit_code == 0
    assert RunDirectory(run).seal.problems() == []
    assert sorted(read_json(run / "manifest.json")["files"]) == written_files(run)


class _Killed(BaseException):
    """A crash inside a write: nothing after it runs (not even the interrupted-status write, as with kill -9)."""


WRITES = 24  # a three-round DP run: config, membership and manifest at start-up, 7 per round (2 of them the manifest)


@pytest.mark.parametrize("write", range(WRITES + 1))
def test_a_crash_at_any_write_leaves_a_run_that_checks_and_resumes_exactly(
    trained, tmp_path, monkeypatch, write, fixed_secrets
):
    """Crash at the k-th file write of a run (files and manifests alike), then give the same command again (a new
    run that never committed a round left nothing) or resume: the run checks at every point and ends byte for byte
    like an uninterrupted one, with no stray file."""
    reference = trained("--dp", "--rounds", "3")
    run = tmp_path / "run"
    real = run_files.atomic_write_bytes
    calls = {"n": 0}

    def crashing(path: Path, data: bytes) -> None:
        if calls["n"] == write:
            raise _Killed
        calls["n"] += 1
        real(path, data)

    monkeypatch.setattr(run_files, "atomic_write_bytes", crashing)
    if write == WRITES:  # no crash: every write of the run was a crash point above
        assert invoke("train", *FAST_ARGS, "--dp", "--rounds", "3", "--out", run).exit_code == 0
        assert calls["n"] == WRITES
        return
    with pytest.raises(_Killed):
        invoke("train", *FAST_ARGS, "--dp", "--rounds", "3", "--out", run)
    monkeypatch.undo()
    if run.exists():
        assert RunDirectory(run).seal.problems() == []
        result = invoke("train", "--resume", run, "--no-progress")
    else:
        result = invoke("train", *FAST_ARGS, "--dp", "--rounds", "3", "--out", run)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    for name in ("model.safetensors", "privacy.json", "checkpoints/round-0003.safetensors"):
        assert (run / name).read_bytes() == (reference / name).read_bytes()
    assert RunDirectory(run).seal.problems() == []
    assert not [p for p in run.rglob("*.tmp")]


# ------------------------------------------------------------------------------------------------------ signing


def _keys(tmp_path: Path, name: str) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.generate()
    private, public = tmp_path / f"{name}.pem", tmp_path / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return private, public


def test_a_signed_run_verifies_with_its_key_only_and_not_once_a_file_is_forged(plain_run, tmp_path):
    run = copy(plain_run, tmp_path)
    private, public = _keys(tmp_path, "site")
    _, other = _keys(tmp_path, "other")
    assert invoke("sign", run, "--key", private).exit_code == 0
    ok = invoke("verify", run, "--public-key", public)
    assert ok.exit_code == 0, ok.output
    assert "PASS signature" in ok.output and "conformance not checked: it was trained without DP" in ok.output
    wrong = invoke("verify", run, "--public-key", other)
    assert wrong.exit_code == 1 and "made with another key" in wrong.output
    assert invoke("attack", run, "--no-progress").exit_code == 0
    later = invoke("verify", run, "--public-key", public)
    assert later.exit_code == 0 and "not signed (written after signing): attacks/" in later.output
    metrics = run / "metrics.csv"
    metrics.write_text(metrics.read_text().replace("0.", "0.9", 1))
    rehash(run)  # a forger who re-records the hashes cannot re-sign
    forged = invoke("verify", run, "--public-key", public)
    assert forged.exit_code == 1 and "FAIL signature: metrics.csv changed after the run was signed" in forged.output
    signature = json.loads((run / "signature.json").read_text())
    signature["manifest"]["rounds_done"] = 1
    (run / "signature.json").write_text(json.dumps(signature))
    assert "does not verify" in invoke("verify", run, "--public-key", public).output


def test_a_signed_run_with_any_file_changed_fails_verify_even_with_its_hashes_re_recorded(plain_run, tmp_path):
    """Every file of a signed run in turn, the manifest and the signature included: one byte flipped (and, but for
    the manifest, every hash re-recorded as a forger would), and `verify --public-key` fails."""
    signed = copy(plain_run, tmp_path, "signed")
    private, public = _keys(tmp_path, "site")
    assert invoke("sign", signed, "--key", private).exit_code == 0
    names = sorted(p.relative_to(signed).as_posix() for p in signed.rglob("*") if p.is_file() and p.name != LOCK_NAME)
    assert {"manifest.json", "signature.json", "model.safetensors", "config.json"} <= set(names)
    for name in names:
        run = copy(signed, tmp_path, f"forged-{name.replace('/', '-')}")
        flip_middle_byte(run / name)
        if name not in ("manifest.json", "signature.json"):
            rehash(run)
        result = invoke("verify", run, "--public-key", public)
        assert result.exit_code != 0 and "PASS signature" not in result.output, (name, result.output)


def test_verify_keeps_the_signature_it_checks_and_the_signature_covers_the_manifest(tmp_path):
    """Sign a canary run whose attack already wrote verification.json, then verify, verify: each passes (verify's own
    result is rewritten each time, and is listed as written after signing). An attack run again rewrites signed
    results: the signature fails them (nothing tells a rerun from a forgery) until the run is signed again. A field
    of the manifest changed after signing fails, even with the hashes re-recorded."""
    run = tmp_path / "run"
    assert invoke("train", *FAST_ARGS, "--dp", "--canaries", "50", "--rounds", "1", "--out", run).exit_code == 0
    assert invoke("attack", run, "--method", "canary").exit_code == 0 and (run / "verification.json").is_file()
    private, public = _keys(tmp_path, "site")
    assert invoke("sign", run, "--key", private).exit_code == 0
    signed = (run / "verification.json").read_bytes()
    for _ in range(2):
        checked = (run / "verification.json").read_bytes()  # what this verify checks, before it writes its own
        result = invoke("verify", run, "--public-key", public)
        assert result.exit_code == 0 and "PASS signature" in result.output, result.output
        # listed when its bytes changed since signing (its time is in seconds: a fast machine may rewrite the same)
        listed = "verification.json" in result.output.partition("not signed (written after signing):")[2]
        assert listed == (checked != signed), result.output
    results = sorted((run / "attacks").rglob("metrics.json"))
    before = [path.read_bytes() for path in results]
    assert invoke("attack", run, "--method", "canary").exit_code == 0
    rewritten = [path.read_bytes() for path in results] != before  # the same bytes within the same second
    result = invoke("verify", run, "--public-key", public)
    assert (result.exit_code == 1) == rewritten, result.output
    assert ("an attack run again after signing: sign again" in result.output) == rewritten, result.output
    assert invoke("sign", run, "--key", private).exit_code == 0
    signed = (run / "verification.json").read_bytes()
    result = invoke("verify", run, "--public-key", public)
    assert result.exit_code == 0 and "PASS signature" in result.output, result.output
    later = json.loads(signed)
    later["created"] = "2099-01-01T00:00:00+00:00"  # what a verify a second later writes differs in its time only
    (run / "verification.json").write_text(json.dumps(later))
    rehash(run)  # as fedaudit records what it writes
    result = invoke("verify", run, "--public-key", public)
    assert result.exit_code == 0 and "PASS signature" in result.output, result.output
    assert "verification.json" in result.output.partition("not signed (written after signing):")[2]
    for field, value in (("dataset", {"name": "forged"}), ("created", "2020-01-01T00:00:00Z"), ("versions", {})):
        forged = tmp_path / f"forged-{field}"
        shutil.copytree(run, forged)
        manifest = json.loads((forged / "manifest.json").read_text())
        manifest[field] = {**manifest[field], **value} if isinstance(value, dict) and value else value
        (forged / "manifest.json").write_text(json.dumps(manifest))
        result = invoke("verify", forged, "--public-key", public)
        assert result.exit_code == 1, result.output
        assert f"FAIL signature: manifest.json's {field} changed after the run was signed" in result.output


def test_signing_refuses_a_tampered_run_and_bad_keys(plain_run, tmp_path):
    run = copy(plain_run, tmp_path)
    (tmp_path / "junk.pem").write_text("not a key")
    assert_user_error(invoke("sign", run, "--key", tmp_path / "junk.pem"), mentions="junk.pem")
    assert_user_error(invoke("sign", run, "--key", tmp_path / "missing.pem"), mentions="missing.pem")
    private, public = _keys(tmp_path, "site")
    assert_user_error(invoke("verify", run, "--public-key", private), mentions="not a PEM public key")
    flip_middle_byte(run / "model.safetensors")
    assert_user_error(invoke("sign", run, "--key", private), mentions="model.safetensors was changed")
    assert not (run / "signature.json").exists()


# ------------------------------------------------------------------------------------------- the one-writer lock


def test_a_second_writer_is_told_who_holds_the_run(plain_run, tmp_path):
    run = copy(plain_run, tmp_path)
    held = RunDirectory(run).lock("fedaudit train --resume")
    try:
        before = tree_digest(run)
        for args in (
            ("train", "--resume", run, "--no-progress"),
            ("attack", run, "--no-progress"),
            ("verify", run),
            ("report", run, "--out", tmp_path),
        ):
            line = assert_user_error(invoke(*args))
            assert f"in use by pid {os.getpid()} (fedaudit train --resume)" in line, line
        overwrite = invoke("train", *FAST_ARGS, "--out", run, "--overwrite")
        assert f"in use by pid {os.getpid()}" in assert_user_error(overwrite)
        assert tree_digest(run) == before
    finally:
        held.release()
    assert invoke("attack", run, "--no-progress").exit_code == 0


def test_writers_that_really_overlap_get_one_sentence_naming_the_holder(plain_run, tmp_path):
    """Another process resumes the run (its own interpreter, holding the lock while it trains); while it does, a
    second `train --resume` and an `attack` are each refused in one sentence naming that process's pid, and the
    holder finishes its rounds undisturbed. (Two commands started together often do not overlap at all: the lock is
    held from the moment a command has loaded, about 2 s of a 14 s `attack` here, so the second may run after.)"""
    import subprocess
    import sys
    import time

    run = copy(plain_run, tmp_path)
    code = "import sys; from fedaudit.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "train", "--resume", str(run), "--rounds", "60", "--no-progress"]
    holder = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        named = f"pid {holder.pid} (fedaudit train --resume)"
        deadline = time.monotonic() + 120
        while holder.poll() is None and time.monotonic() < deadline:
            if (run / ".fedaudit.lock").is_file() and (run / ".fedaudit.lock").read_text().startswith(named):
                break
            time.sleep(0.01)
        assert holder.poll() is None, "the holder finished before it could be overlapped"
        for args in (("train", "--resume", run, "--rounds", "61", "--no-progress"), ("attack", run, "--no-progress")):
            line = assert_user_error(invoke(*args), mentions=f"in use by {named}")
            assert holder.poll() is None, "the holder finished while the second writer ran: no overlap was tested"
            assert line.endswith("try again when it has finished.")
        assert holder.wait(timeout=300) == 0, holder.stderr.read()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert read_json(run / "manifest.json")["rounds_done"] == 60
    assert RunDirectory(run).seal.problems() == []


def test_an_unfinished_run_is_attacked_only_at_a_finished_round(plain_run, tmp_path):
    run = copy(plain_run, tmp_path)
    manifest = read_json(run / "manifest.json")
    manifest.update(status="interrupted", rounds_done=2)
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_user_error(invoke("attack", run, "--no-progress"), mentions="--target round:2")


# --------------------------------------------------------------------------------------------------- start-up


def test_a_half_made_run_of_an_older_version_is_named_and_overwritten(plain_run, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    shutil.copy(plain_run / "config.json", out / "config.json")
    assert_user_error(invoke("train", *FAST_ARGS, "--rounds", "3", "--out", out), mentions="start was interrupted")
    assert_user_error(invoke("train", "--resume", out, "--no-progress"), mentions="start was interrupted")
    result = invoke("train", *FAST_ARGS, "--rounds", "3", "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert (out / "model.safetensors").read_bytes() == (plain_run / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_leftovers_of_a_killed_start_are_cleared_by_the_next(plain_run, tmp_path):
    out = tmp_path / "run"
    leftover = tmp_path / ".run.partial-abc123"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    (tmp_path / ".run.replaced-99").mkdir()
    result = invoke("train", *FAST_ARGS, "--rounds", "3", "--out", out)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (out / "model.safetensors").read_bytes() == (plain_run / "model.safetensors").read_bytes()


def test_keep_checkpoints_keeps_the_last_rounds_and_resumes_exactly(trained, tmp_path, fixed_secrets):
    constant = ("--dp", "--lr-schedule", "constant")  # with the cosine schedule the horizon changes the steps
    reference = trained(*constant, "--rounds", "3")
    run = tmp_path / "run"
    result = invoke("train", *FAST_ARGS, *constant, "--rounds", "2", "--keep-checkpoints", "1", "--out", run)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round-0002.json", "round-0002.safetensors"]
    assert RunDirectory(run).seal.problems() == []
    assert invoke("train", "--resume", run, "--rounds", "3", "--no-progress").exit_code == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round-0003.json", "round-0003.safetensors"]
    assert (run / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert RunDirectory(run).seal.problems() == []
    assert_user_error(invoke("attack", run, "--target", "round:2", "--no-progress"), mentions="saved rounds: 3")


def test_results_of_an_earlier_final_model_are_named_when_a_policy_needs_them(trained, tmp_path):
    run = copy(trained("--rounds", "2"), tmp_path)
    assert invoke("attack", run, "--no-progress").exit_code == 0
    assert invoke("train", "--resume", run, "--rounds", "3", "--no-progress").exit_code == 0
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_attack_auc: 0.9\n")
    result = invoke("report", run, "--out", tmp_path / "report.md", "--policy", policy)
    assert result.exit_code == 1
    markdown = (tmp_path / "report.md").read_text()
    assert "the results under attacks/ are of round 2, and the run has 3 rounds now" in markdown


def _without_times(path: Path) -> str:
    """A file's text without the lines that hold a clock time ("created") or the run's own path ("run")."""
    volatile = ("created", "Created", '"run":')
    return "\n".join(line for line in path.read_text().splitlines() if not any(v in line for v in volatile))


@pytest.mark.parametrize("write", range(0, 20, 3))
def test_an_attack_crashed_at_any_write_gives_the_same_results_when_given_again(
    plain_run, tmp_path, monkeypatch, write
):
    reference = copy(plain_run, tmp_path, "reference")
    assert invoke("attack", reference, "--no-progress").exit_code == 0
    run = copy(plain_run, tmp_path)
    real, calls = run_files.atomic_write_bytes, {"n": 0}

    def crashing(path: Path, data: bytes) -> None:
        if calls["n"] == write:
            raise _Killed
        calls["n"] += 1
        real(path, data)

    monkeypatch.setattr(run_files, "atomic_write_bytes", crashing)
    with pytest.raises(_Killed):
        invoke("attack", run, "--no-progress")
    monkeypatch.undo()
    assert RunDirectory(run).seal.problems() == []
    assert invoke("attack", run, "--no-progress").exit_code == 0
    for result in sorted((reference / "attacks").glob("*/*")):
        relative = result.relative_to(reference)
        assert _without_times(run / relative) == _without_times(result), relative
    assert not list(run.rglob("*.tmp")) and RunDirectory(run).seal.problems() == []


@pytest.mark.parametrize("write", range(5))  # the marker, the report, summary.csv, groups.csv, summary.json
def test_a_report_crashed_at_any_write_is_written_whole_by_the_same_command(dp_run, tmp_path, monkeypatch, write):
    import fedaudit.reports.render as render

    assert invoke("report", dp_run, "--out", tmp_path / "reference" / "r.md").exit_code == 0
    real, calls = render.atomic_write_bytes, {"n": 0}

    def crashing(path: Path, data: bytes) -> None:
        if calls["n"] == write:
            raise _Killed
        calls["n"] += 1
        real(path, data)

    monkeypatch.setattr(render, "atomic_write_bytes", crashing)
    monkeypatch.setattr(run_files, "atomic_write_bytes", crashing)  # the marker, written through atomic_write_json
    with pytest.raises(_Killed):
        invoke("report", dp_run, "--out", tmp_path / "out" / "r.md")
    monkeypatch.undo()
    assert invoke("report", dp_run, "--out", tmp_path / "out" / "r.md").exit_code == 0
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "reference").iterdir())  # no marker, no temporary
    for name in names:
        assert _without_times(tmp_path / "out" / name) == _without_times(tmp_path / "reference" / name), name
    assert invoke("report", dp_run, "--out", tmp_path / "out" / "r.md").exit_code == 2  # a whole report: refused


@pytest.mark.parametrize("name", ["metrics.csv", "privacy.json", "config.json"])
def test_a_run_file_grown_beyond_any_fedaudit_writes_is_one_sentence_before_it_is_read(
    dp_run, tmp_path, monkeypatch, name
):
    """The size is checked before a run file is read whole (a 3 GB metrics.csv once took the report to 24 GB): here
    with the limit lowered to a few kB, so that the test need not write gigabytes."""
    run = copy(dp_run, tmp_path)
    monkeypatch.setattr(run_files, "MAX_RUN_TEXT_BYTES", 4096)
    path = run / name
    path.write_bytes(path.read_bytes() + b" " * 8192)
    result = invoke("report", run, "--out", tmp_path / "r.md")
    message = assert_user_error(result, mentions=f"{name} was changed after fedaudit wrote it", exit_code=1)
    assert "larger than any file fedaudit writes" in message
    assert not (tmp_path / "r.md").exists()


# ------------------------------------------------------------------ edits that parse: the integrity check comes first


def _renamed_bound_count(metrics: dict) -> None:
    test = metrics["epsilon_lower_bound_test"]
    test["false_positivez"] = test.pop("false_positives")


def _exposed_as_text(metrics: dict) -> None:
    metrics["risk"]["most_exposed"] = "x"


def _client_named_in_words(metrics: dict) -> None:
    rates = metrics["risk"]["tpr_at_fpr_per_client"]
    rates["first"] = rates.pop(next(iter(rates)))


def _count_as_text(metrics: dict) -> None:
    metrics["epsilon_lower_bound_test"]["bound_members"] = "many"


@pytest.fixture(scope="module")
def attacked_run(plain_run, tmp_path_factory) -> Path:
    run = copy(plain_run, tmp_path_factory.mktemp("attacked"))
    assert invoke("attack", run, "--signal", "loss", "--method", "threshold", "--no-progress").exit_code == 0
    return run


@pytest.mark.parametrize(
    "edit",
    [_renamed_bound_count, _exposed_as_text, _client_named_in_words, _count_as_text],
    ids=["bound-key-renamed", "exposed-records-text", "client-id-text", "count-text"],
)
def test_a_valid_json_edit_of_an_attack_result_is_named_and_never_read(attacked_run, tmp_path, edit):
    """The issue's case (a renamed key of an attack's metrics.json took `report` to a traceback): the integrity check
    names the file, the result is left out unread, and the report is written with its FAIL (exit 1). With the hashes
    re-recorded by a forger, the malformed entries read as absent and the report is written (exit 0)."""
    run = copy(attacked_run, tmp_path)
    path = run / "attacks" / "loss-threshold" / "metrics.json"
    metrics = read_json(path)
    edit(metrics)
    path.write_text(json.dumps(metrics))
    result = invoke("report", run, "--out", tmp_path / "report", "--format", "md")
    assert result.exit_code == 1, result.output
    assert "attacks/loss-threshold/metrics.json was changed after fedaudit wrote it" in result.output
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "The attack result loss-threshold was changed after fedaudit wrote it" in markdown
    rehash(run)
    forged = invoke("report", run, "--out", tmp_path / "forged", "--format", "md")
    assert forged.exit_code == 0, forged.output
    assert "Traceback" not in forged.output


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("config.json", "{not json"),
        ("config.json", json.dumps({"model": {"arch": None}})),
        ("config.json", json.dumps({"federated": {"algorithm": ["fedavg"]}})),
        ("metrics.csv", "round,test_accuracy\n1,high\n"),
        ("metrics.csv", ""),
        ("privacy.json", json.dumps({"accountant": ["rdp"]})),
    ],
    ids=["not-json", "arch-null", "algorithm-list", "metrics-text", "metrics-empty", "accountant-list"],
)
def test_a_corrupt_record_of_the_run_is_its_integrity_fail_not_bad_input(dp_run, tmp_path, name, content):
    """config.json, metrics.csv or privacy.json that cannot be read, edited after training: the report cannot be laid
    out, and says why in one sentence with the exit code of an integrity FAIL (1), not 2 as for a bad option; it
    writes nothing."""
    run = copy(dp_run, tmp_path)
    path = run / name
    if content.startswith("{") and name != "metrics.csv" and "not json" not in content:
        merged = read_json(path)
        for section, values in json.loads(content).items():
            merged[section] = {**merged[section], **values} if isinstance(merged[section], dict) else values
        content = json.dumps(merged)
    path.write_text(content)
    before = tree_digest(tmp_path)
    line = assert_user_error(
        invoke("report", run, "--out", tmp_path / "report"), mentions=f"{name} was changed", exit_code=1
    )
    assert "FAIL: its files are not those fedaudit wrote" in line and "no report was written" in line
    assert tree_digest(tmp_path) == before


def test_a_forged_configuration_that_is_not_text_is_one_sentence(dp_run, tmp_path):
    """The same edits with the hashes re-recorded: no integrity problem to name, so a bad configuration (exit 2),
    in one sentence and not a traceback."""
    for key, value in (("model", {"arch": None}), ("federated", {"algorithm": ["fedavg"]})):
        run = copy(dp_run, tmp_path, f"run-{key}")
        config = read_json(run / "config.json")
        config[key].update(value)
        (run / "config.json").write_text(json.dumps(config))
        rehash(run)
        assert_user_error(invoke("report", run, "--out", tmp_path / "report"), mentions="must be text")


@pytest.fixture(scope="module")
def canary_audited(trained, tmp_path_factory) -> Path:
    run = copy(trained("--dp", "--rounds", "1", "--canaries", "50"), tmp_path_factory.mktemp("canary"))
    assert invoke("attack", run, "--method", "canary", "--no-progress").exit_code == 0
    return run


@pytest.mark.parametrize(
    "forge",
    [
        lambda audit: audit["canary_audit"]["estimators"].pop("gdp"),
        lambda audit: audit["canary_audit"]["bound_by_guesses"].append({"guesses": "all", "epsilon": 1.0}),
        lambda audit: audit["canary_audit"].pop("canary_kind"),
        lambda audit: audit["canary_audit"]["estimate"].update(ci95=None),
        lambda audit: audit.update(epsilon_lower_bound=None),
    ],
    ids=["estimator-removed", "guesses-text", "kind-removed", "interval-null", "bound-null"],
)
def test_a_forged_canary_audit_is_left_out_not_laid_out(canary_audited, tmp_path, forge):
    """A canary audit's metrics.json edited by a forger who re-records the hashes (so that the integrity check has
    nothing to name): the result is left out with a note, and the report is written, without a traceback."""
    run = copy(canary_audited, tmp_path)
    path = run / "attacks" / "update-projection-canary" / "metrics.json"
    audit = read_json(path)
    forge(audit)
    path.write_text(json.dumps(audit))
    rehash(run)
    result = invoke("report", run, "--out", tmp_path / "report", "--format", "md", "--format", "html")
    assert result.exit_code in (0, 1), result.output
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "The attack result update-projection-canary is unreadable and is left out." in markdown


def test_verify_checks_the_files_and_ledger_of_a_dp_run_trained_without_the_query_log(tmp_path):
    """As for a client-level run without --save-transmitted: its files and ledger are checked, and verify says why
    its mechanism was not (it was one sentence and exit code 2, which a run without DP still is)."""
    run = tmp_path / "dp"
    assert invoke("train", *FAST_ARGS, "--dp", "--rounds", "1", "--out", run).exit_code == 0
    result = invoke("verify", run)
    assert result.exit_code == 0, result.output
    assert "PASS integrity" in result.output
    assert (
        "conformance not checked: it was trained without --canaries, so it has no query log to check" in result.output
    )
    (run / "metrics.csv").write_text((run / "metrics.csv").read_text().replace("0.", "0.9", 1))
    assert invoke("verify", run).exit_code == 1


def test_a_hostile_run_cannot_lead_fedaudit_outside_it(plain_run, tmp_path):
    """A run handed over by someone else: a lock that links to another file (writers truncate their lock), a folder
    that links outside the run (attack wrote its results there), a manifest naming a path outside the run with the
    right hash (export copied onto it; verify read and judged it), a configuration that is /dev/zero or a FIFO
    (memory, or a wait for ever). Each is a sentence or a FAIL; nothing outside the run is read for or written."""
    victim = tmp_path / "victim"
    victim.mkdir()
    precious = victim / "precious.txt"
    precious.write_text("keep me")
    locked = copy(plain_run, tmp_path, "locked")
    (locked / LOCK_NAME).unlink(missing_ok=True)
    (locked / LOCK_NAME).symlink_to(precious)
    for command in (("attack", locked, "--signal", "loss", "--no-progress"), ("verify", locked)):
        result = invoke(*command)
        assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
    assert precious.read_text() == "keep me"
    linked = copy(plain_run, tmp_path, "linked")
    (linked / "attacks").symlink_to(victim, target_is_directory=True)
    result = invoke("verify", linked)
    assert result.exit_code == 1 and "attacks is a symbolic link" in result.output, result.output
    assert invoke("attack", linked, "--signal", "loss", "--no-progress").exit_code == 2
    assert sorted(p.name for p in victim.iterdir()) == ["precious.txt"]
    named = copy(plain_run, tmp_path, "named")
    manifest = json.loads((named / "manifest.json").read_text())
    escape = "../" * len(named.parts) + precious.as_posix().lstrip("/")
    manifest["files"][escape] = hashlib.sha256(precious.read_bytes()).hexdigest()
    (named / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("verify", named)
    assert result.exit_code == 1 and "which is not a file of the run" in result.output, result.output
    assert invoke("export", named, "--out", tmp_path / "copy").exit_code == 2
    assert precious.read_text() == "keep me" and not (tmp_path / "copy").exists()
    for kind in ("zero", "fifo"):
        odd = copy(plain_run, tmp_path, f"odd-{kind}")
        (odd / "config.json").unlink()
        if kind == "zero":
            (odd / "config.json").symlink_to("/dev/zero")
        else:
            os.mkfifo(odd / "config.json")
        for command in (("verify", odd), ("report", odd, "--out", tmp_path / f"report-{kind}")):
            result = invoke(*command)
            assert result.exit_code in (1, 2) and "Traceback" not in result.output, result.output
    inside = copy(plain_run, tmp_path, "inside")
    result = invoke("export", inside, "--out", inside / "copy")
    assert result.exit_code == 2 and "is inside the run" in result.output
    checked = invoke("verify", inside)  # a run without DP: its files and ledger checked, and said to have no DP
    assert checked.exit_code == 0 and "PASS integrity" in checked.output, checked.output
    assert "it was trained without DP, so it has no mechanism to check" in checked.output


def test_a_signed_attack_result_changed_after_signing_fails_the_signature(plain_run, tmp_path):
    """Anyone can rehash a manifest: a signed AUC edited to 0.5 was excused as 'rewritten after signing', and the
    report showed it. A signed result that changed fails, whoever changed it; a new one is listed as not signed."""
    run = copy(plain_run, tmp_path)
    private, public = _keys(tmp_path, "site")
    assert invoke("attack", run, "--signal", "loss", "--method", "threshold", "--no-progress").exit_code == 0
    assert invoke("sign", run, "--key", private).exit_code == 0
    metrics = run / "attacks" / "loss-threshold" / "metrics.json"
    forged = json.loads(metrics.read_text())
    forged["auc"] = 0.5
    metrics.write_text(json.dumps(forged))
    rehash(run)
    result = invoke("verify", run, "--public-key", public)
    assert result.exit_code == 1, result.output
    assert "attacks/loss-threshold/metrics.json changed after the run was signed" in result.output


def test_a_runs_arrays_are_read_only_as_arrays_and_within_their_size(plain_run, tmp_path):
    """A hash-valid membership.npz with a member that is not an array (numpy would read it whole: a zip bomb's way
    in) or whose header promises more than any run writes is one sentence, read no further."""
    import io
    import zipfile

    import numpy as np

    for kind in ("notes", "huge"):
        run = copy(plain_run, tmp_path, kind)
        with zipfile.ZipFile(run / "membership.npz", "a") as archive:
            if kind == "notes":
                archive.writestr("notes", b"not an array")
            else:
                header = io.BytesIO()  # 2 GiB of float64 promised, none of it there
                np.lib.format.write_array_header_1_0(
                    header, {"descr": "<f8", "fortran_order": False, "shape": (1 << 28,)}
                )
                archive.writestr("huge.npy", header.getvalue())
        rehash(run)
        result = invoke("attack", run, "--signal", "loss", "--no-progress")
        assert result.exit_code == 2 and "membership.npz" in result.output and "Traceback" not in result.output, (
            result.output
        )


def test_what_changes_after_the_check_is_not_copied_and_a_lock_or_record_cannot_stand_in(plain_run, tmp_path):
    """After a run checks, export copies each file opened without following a link on the way and hashed as it is
    copied (a file swapped for a link to another file was copied from outside the run); a lock that is a hard link
    (truncating it truncates another file) is refused; an export record planted in the run itself excuses nothing
    (the server's records could be deleted unseen) and makes a run that cannot be resumed; a name of 5,000
    characters in the manifest is a finding, not a traceback."""
    from fedaudit.rundir import integrity

    run = copy(plain_run, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's")
    recorded = json.loads((run / "manifest.json").read_text())["files"]
    target = tmp_path / "copied"
    integrity.copy_checked(run, "metrics.csv", target, {recorded["metrics.csv"]})
    assert target.read_bytes() == (run / "metrics.csv").read_bytes()
    (run / "metrics.csv").rename(tmp_path / "metrics.csv")
    (run / "metrics.csv").symlink_to(outside)
    with pytest.raises(integrity.IntegrityError, match="cannot be copied from inside the run"):
        integrity.copy_checked(run, "metrics.csv", target, {recorded["metrics.csv"]})
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").write_text("changed")
    with pytest.raises(integrity.IntegrityError, match="changed while it was being copied"):
        integrity.copy_checked(run, "metrics.csv", target, {recorded["metrics.csv"]})
    first = sorted((run / "checkpoints").iterdir())[0].name
    (run / "checkpoints").rename(tmp_path / "elsewhere")
    (run / "checkpoints").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(integrity.IntegrityError, match="cannot be copied from inside the run"):
        integrity.copy_checked(run, f"checkpoints/{first}", target)
    linked = copy(plain_run, tmp_path, "hard")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (linked / LOCK_NAME).unlink(missing_ok=True)
    os.link(victim, linked / LOCK_NAME)
    result = invoke("attack", linked, "--signal", "loss", "--no-progress")
    assert result.exit_code == 2 and "not a regular file of its own" in result.output, result.output
    assert victim.read_text() == "keep me"
    planted = copy(plain_run, tmp_path, "planted")
    (planted / "export.json").write_text(json.dumps({"format": "fedaudit-export", "left_out": {}}))
    result = invoke("train", "--resume", planted, "--rounds", "4")
    assert result.exit_code == 2 and "a copy made for others by fedaudit export" in result.output, result.output
    named = copy(plain_run, tmp_path, "named")
    manifest = json.loads((named / "manifest.json").read_text())
    manifest["files"]["x" * 5000] = "0" * 64
    (named / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("verify", named)
    assert result.exit_code == 1 and "which is not a file of the run" in result.output, result.output
