"""The verdict block at the top of every report: one sentence per run (its promise, what the attacks showed, what was
checked), its status, and what was not shown; a broken run is FAIL whatever the policy says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import invoke

from fedaudit.reports.collect import collect_runs
from fedaudit.reports.verdict import NO_POLICY, run_verdict


@pytest.fixture(scope="module")
def attacked(dp_run, tmp_path_factory) -> Path:
    run = Path(shutil.copytree(dp_run, tmp_path_factory.mktemp("verdict") / "dp"))
    assert invoke("attack", run, "--no-progress").exit_code == 0
    return run


def test_a_dp_run_says_its_promise_what_the_attacks_showed_and_what_was_not_checked(attacked):
    (run,) = collect_runs([attacked])
    epsilon = json.loads((attacked / "privacy.json").read_text())["epsilon_per_round"][-1]
    verdict = run_verdict(run, {"verdict": "NOT CHECKED", "failures": [], "unchecked": ["no canary audit"]}, None, None)
    assert verdict.status == NO_POLICY
    assert verdict.sentence.startswith(f"DP-FedAvg promises epsilon {epsilon:.3f} at delta 1e-05 per record after 3 ")
    assert "no attack showed more than the accountant: the strongest of 4 attacks" in verdict.sentence
    assert verdict.sentence.endswith("the implementation was not fully checked.")
    assert verdict.not_shown == ("no canary audit",)


def test_evidence_against_the_promise_is_a_fail_even_when_the_policy_passes(attacked):
    (run,) = collect_runs([attacked])
    exceeds = {"attack": "loss-threshold", "bound": 9.0, "accountant": 2.0}
    verdict = run_verdict(run, None, exceeds, "PASS")
    assert (
        verdict.status == "FAIL" and "an attack proved more: loss-threshold shows epsilon ≥ 9 (95%)" in verdict.sentence
    )
    failed = {"verdict": "FAIL", "failures": ["noise: too small"], "unchecked": []}
    verdict = run_verdict(run, failed, None, "PASS")
    assert verdict.status == "FAIL" and "the implementation checks failed (noise: too small)" in verdict.sentence


def test_a_run_without_attacks_says_what_was_not_shown(plain_run):
    (run,) = collect_runs([plain_run])
    verdict = run_verdict(run, None, None, None)
    assert verdict.sentence == "FedAvg promises no differential privacy; no attack was run on its final model."
    assert verdict.not_shown[0].startswith("membership inference: no attack results for the final model")


def test_the_block_opens_the_report_with_the_policy_verdict_per_run(attacked, plain_run, tmp_path):
    tampered = Path(shutil.copytree(attacked, tmp_path / "tampered"))
    (tampered / "metrics.csv").write_text("round,test_accuracy\n1,0.99\n")
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_epsilon: 1000\n")
    result = invoke("report", attacked, plain_run, tampered, "--out", tmp_path / "r.html", "--policy", policy)
    assert result.exit_code == 1
    html = (tmp_path / "r.html").read_text()
    assert html.index('id="verdict"') < html.index('id="policy"') < html.index('id="run-1"')
    block = html[html.index('id="verdict"') : html.index('id="policy"')]
    assert block.count('<td class="pass">PASS</td>') == 1  # the attacked DP run meets the limit
    assert block.count('<td class="fail">FAIL</td>') == 2  # no DP guarantee; files not those fedaudit wrote
    assert "Its files are not those fedaudit wrote (metrics.csv was changed" in block
    assert invoke("report", attacked, "--out", tmp_path / "md" / "r.md").exit_code == 0
    markdown = (tmp_path / "md" / "r.md").read_text()
    assert markdown.index("## Verdict") < markdown.index("## Run ")
    assert "- **NO POLICY** `dp`: DP-FedAvg promises epsilon" in markdown
