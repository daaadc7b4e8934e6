"""max_reconstruction_psnr: judged on each attacked round's interval, its clients' records pooled; one record has no
interval and cannot decide; a run without reconstruction results fails the limit with the command that makes them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd

from fedaudit.reports.collect import PrivacySummary, ReconstructionSummary, RunSummary
from fedaudit.reports.policy import FAIL, INCONCLUSIVE, PASS, Policy, check_run


def _result(round_number: int, client: int, psnrs: list[float]) -> ReconstructionSummary:
    values = np.array(psnrs)
    return ReconstructionSummary(
        name=f"reconstruction-round-{round_number}-client-{client}",
        round=round_number,
        client=client,
        view="update-inversion",
        null_kind="random-update",
        threshold=20.0,
        accountant_epsilon=None,
        psnr=values,
        ssim=np.full(len(values), 0.5),
        null_psnr=np.full(len(values), 6.5),
        null_ssim=np.zeros(len(values)),
    )


def _run(*results: ReconstructionSummary) -> RunSummary:
    return RunSummary(
        name="run",
        path=Path("run"),
        setup={"rounds done": 2, "algorithm": "FedSGD", "privacy budget": "no DP"},
        utility=pd.DataFrame(),
        privacy=PrivacySummary(dp=False),
        attacks=(),
        synthetic=(),
        notes=(),
        reconstructions=results,
    )


def _verdict(run: RunSummary, limit: float) -> tuple[str, str]:
    (check,) = check_run(Policy(max_reconstruction_psnr=limit), run)
    return check.verdict, check.detail


def test_each_round_is_judged_on_its_pooled_interval() -> None:
    # round 1 pools two clients: mean 20, t interval 20 +- t(0.975, 3) * sd / 2 with sd = 1.826 (n = 4)
    run = _run(_result(1, 0, [18.0, 21.0]), _result(1, 3, [19.0, 22.0]), _result(2, 1, [8.0, 9.0, 7.0]))
    half = 3.182446305284263 * np.std([18.0, 21.0, 19.0, 22.0], ddof=1) / 2.0
    assert _verdict(run, 20.0 + half + 0.01)[0] == PASS
    assert _verdict(run, 20.0 - half - 0.01)[0] == FAIL
    verdict, detail = _verdict(run, 20.5)
    assert verdict == INCONCLUSIVE and "round 1 (2 clients)" in detail and "n=4 records" in detail
    assert "records would resolve it" in detail


def test_one_record_cannot_decide_and_no_result_fails() -> None:
    verdict, detail = _verdict(_run(_result(1, 0, [40.0])), 20.0)
    assert verdict == INCONCLUSIVE and "from one record" in detail
    verdict, detail = _verdict(replace(_run(), reconstructions=()), 20.0)
    assert verdict == FAIL and "--method reconstruction" in detail
