"""``fedaudit verify``: every run's files and ledger against its manifest, its signature, and the conformance of its
mechanism (attacks/conformance/checks.py, and with ``--probe`` attacks/conformance/probe.py), written to the run's
verification.json."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import fedaudit
from fedaudit.attacks.conformance import client_level
from fedaudit.attacks.conformance.checks import Verification, verify
from fedaudit.attacks.conformance.probe import probe_run
from fedaudit.rundir import RunDirectory, json_bytes, now_iso


@dataclass(frozen=True)
class VerifyOutcome:
    """What ``fedaudit verify`` found about one run: its files and ledger, its signature (when a key is given) and
    the conformance of its mechanism (None when the run has nothing to check or its files failed)."""

    path: Path
    integrity: tuple[str, ...]
    signature: tuple[str, ...] | None
    unsigned: tuple[str, ...]  # files written after the run was signed (attack results): not covered, not failed
    verification: Any
    skipped: str | None = None  # why the conformance checks did not run

    @property
    def passed(self) -> bool:
        conformance = self.verification is None or self.verification.passed
        return not self.integrity and not self.signature and conformance


def verify_runs(
    run_dirs: Sequence[str | Path], *, seed: int, public_key: bytes | None = None, probe: bool = False
) -> list[VerifyOutcome]:
    """``fedaudit verify``: every run's files and ledger against its manifest, its signature against ``public_key``,
    then the conformance checks of its mechanism (and, with ``probe``, the sensitivity probe of its DP query:
    attacks/conformance/probe.py), written to its verification.json. Every run is read and checked before anything
    is written, so bad input leaves nothing behind; a run whose files fail is not verified further and nothing is
    written into it."""
    outcomes = []
    for path in run_dirs:
        run = RunDirectory(path)
        run.read_manifest()
        with run.lock("fedaudit verify", shared=True):
            problems = tuple(run.seal.problems())
            signature, unsigned = (None, ()) if public_key is None else run.seal.signature_problems(public_key)
            verification, skipped = None, None
            privacy = None if problems else run.read_run_config().privacy  # read once, and only from intact files
            if privacy is None:
                skipped = "its files are not those fedaudit wrote"
            elif privacy.client_level:
                skipped = client_level.needs(run)
                if skipped is None:
                    verification = client_level.verify_client_level(run)
            elif not run.queries_dir.is_dir() or not privacy.dp:
                skipped = (  # its files and ledger are checked all the same
                    "it was trained without --canaries, so it has no query log to check"
                    if privacy.dp
                    else "it was trained without DP, so it has no mechanism to check"
                )
                if probe:
                    verification = Verification(checks=[probe_run(run)], level=0.001, per_check_level=0.001)
            else:
                verification = verify(run, seed=seed)
                if probe:
                    verification = replace(verification, checks=[*verification.checks, probe_run(run)])
        outcomes.append(VerifyOutcome(Path(path), problems, signature, unsigned, verification, skipped))
    for outcome in outcomes:
        if outcome.verification is not None:
            run = RunDirectory(outcome.path)
            with run.lock("fedaudit verify"):
                write_verification(run, outcome.verification, seed)
    return outcomes


def write_verification(run: RunDirectory, verification: Any, seed: int) -> None:
    """verification.json: the checks, the round they saw, the seed and the version."""
    run.put(
        run.verification_path,
        json_bytes(
            {
                **verification.to_dict(),
                "rounds": run.read_manifest().rounds_done,
                "seed": seed,
                "fedaudit_version": fedaudit.__version__,
                "created": now_iso(),
            }
        ),
    )
