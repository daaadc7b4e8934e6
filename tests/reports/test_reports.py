"""``fedaudit report``: sections and numbers read back from real runs, self-contained HTML, PDF, policy gate, bad
input."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from helpers import CHROMIUM_FLAGS, FAST_ARGS, binary, invoke, pango, rehash
from PIL import Image

LAP_ARGS = tuple(
    (
        "--algorithm fedlap --dp --ipc 1 --trajectories 1 --max-loops 1 --real-batches 1 --image-steps 1 "
        "--model-epochs 1 --server-epochs 2 --rounds 2 --save-transmitted"
    ).split()
)
ATTACK_ARGS = tuple(
    "--target all --signal loss --method threshold --max-records 200 --bootstrap 50 --device cpu --no-progress".split()
)
SECTIONS = ("Setup", "Threat model", "Utility", "Privacy accounting", "Membership inference attacks")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def audited(trained, tmp_path_factory) -> Path:
    """A three-round DP-FedAvg run attacked after every round (loss threshold attack)."""
    run = tmp_path_factory.mktemp("audited") / "dp"
    shutil.copytree(trained("--dp", "--rounds", "3"), run)
    result = invoke("attack", run, *ATTACK_ARGS)
    assert result.exit_code == 0, result.output
    return run


@pytest.fixture(scope="module")
def report(audited, tmp_path_factory) -> Path:
    """The HTML, Markdown and PDF report of the attacked run, in a folder."""
    pango()
    out = tmp_path_factory.mktemp("report") / "out"
    result = invoke("report", audited, "--out", out, "--format", "html", "--format", "md", "--format", "pdf")
    assert result.exit_code == 0, result.output
    return out


def test_report_has_every_section_and_the_run_s_numbers(audited, report):
    html = (report / "report.html").read_text(encoding="utf-8")
    markdown = (report / "report.md").read_text(encoding="utf-8")
    for section in SECTIONS:
        assert f"<h3>{section}</h3>" in html and f"### {section}" in markdown
    summary = read_json(report / "summary.json")
    run = summary["runs"][0]
    config, manifest = read_json(audited / "config.json"), read_json(audited / "manifest.json")
    ledger, metrics = read_json(audited / "privacy.json"), pd.read_csv(audited / "metrics.csv")
    # setup
    assert run["setup"]["algorithm"] == "DP-FedAvg" and run["setup"]["seed"] == config["seed"]
    assert run["setup"]["dataset fingerprint"] == manifest["dataset"]["fingerprint"] in html
    assert run["utility"]["test_accuracy"] == pytest.approx(list(metrics["test_accuracy"]))
    # accounting: q = B / N_k of the worst client, charged in every round it took part in, T from the manifest
    privacy, worst = run["privacy"], ledger["worst_client"]
    n_k = manifest["clients"]["num_examples"][worst]
    assert privacy["sample_rate"] == pytest.approx(config["federated"]["batch_size"] / n_k)
    assert [e["sample_rate"] for e in ledger["entries"]] == pytest.approx([privacy["sample_rate"]])
    charged = sum(1 for row in ledger["history"]["rounds"] if str(worst) in row)
    assert privacy["worst_client_rounds"] == charged
    assert privacy["queries_per_round"] == manifest["clients"]["dp_queries_per_round"][worst]
    assert privacy["epsilon_per_round"] == pytest.approx(ledger["epsilon_per_round"])
    assert privacy["noise_multiplier"] == ledger["noise_multiplier"] and privacy["delta"] == ledger["delta"]
    assert f"{ledger['epsilon_per_round'][-1]:.4g}" in html and "Worst-case assumptions" in html
    # attacks: every result directory, numbers equal to its metrics.json
    directories = sorted(p.name for p in (audited / "attacks").iterdir())
    assert sorted(a["name"] for a in run["attacks"]) == directories and len(directories) == 3
    for attack in run["attacks"]:
        stored = read_json(audited / "attacks" / attack["name"] / "metrics.json")
        assert attack["auc"] == pytest.approx(stored["auc"])
        assert attack["auc_ci"] == pytest.approx(stored["auc_ci95"])
        for key, target in (("tpr_at_1pct_fpr", "0.01"), ("tpr_at_0_1pct_fpr", "0.001")):
            shown, entry = attack[key], stored["tpr_at_fpr"][target]
            assert (shown["tpr"], shown["estimable"], shown["nonmembers_needed"]) == (
                entry["tpr"],
                entry["estimable"],
                entry["nonmembers_needed"],
            )
        assert attack["epsilon_lower_bound_test"] == stored["epsilon_lower_bound_test"]
        assert attack["epsilon_lower_bound"] == pytest.approx(stored["epsilon_lower_bound"])
        assert attack["accountant_epsilon"] == pytest.approx(stored["accountant_epsilon"])
    # figures: accuracy, epsilon, ROC (linear + log-log in one), AUC per round
    assert html.count('<img src="data:image/png;base64,') == 4
    assert run["missing"] == []
    row = pd.read_csv(report / "summary.csv").iloc[0]
    strongest = max((a for a in run["attacks"] if a["round"] == 3), key=lambda a: a["auc"])
    assert row["attack_auc"] == pytest.approx(strongest["auc"]) and row["epsilon"] == pytest.approx(privacy["epsilon"])


def test_html_has_no_external_references(report):
    html = (report / "report.html").read_text(encoding="utf-8")
    assert not re.search(r"https?://|<script|<link|@import|url\(", html, re.IGNORECASE)
    sources = re.findall(r'src="([^"]*)"', html)
    assert sources and all(src.startswith("data:image/png;base64,") for src in sources)


def test_pdf_renders_with_the_report_s_content(report, tmp_path):
    pdftoppm, pdftotext = binary("pdftoppm"), binary("pdftotext")
    subprocess.run([pdftoppm, "-r", "30", "-png", report / "report.pdf", tmp_path / "page"], check=True, timeout=60)
    pages = sorted(tmp_path.glob("page*.png"))
    assert len(pages) >= 2
    assert len(Image.open(pages[0]).convert("RGB").getcolors(1 << 20)) > 8
    text = subprocess.run([pdftotext, report / "report.pdf", "-"], check=True, capture_output=True, text=True).stdout
    epsilon = read_json(report / "summary.json")["runs"][0]["privacy"]["epsilon"]
    for needle in (*SECTIONS, "Worst-case assumptions", f"{epsilon:.4g}"):
        assert needle in text


def test_html_opens_in_chromium_without_errors(report, tmp_path):
    chromium = binary("chromium")
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            f"--screenshot={shot}",
            "--window-size=1280,2000",
            (report / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Uncaught" not in result.stderr and "ERROR:CONSOLE" not in result.stderr
    colours = Image.open(shot).convert("RGB").getcolors(1 << 20)
    assert colours is not None and len(colours) > 16


@pytest.mark.parametrize(
    "limits, verdict",
    [
        ({"max_epsilon": 1000, "delta": 1e-5, "max_attack_auc": 0.99, "min_accuracy": 0.0}, "PASS"),
        ({"max_epsilon": 1.0, "min_accuracy": 0.0}, "FAIL"),
        ({"max_epsilon": 1000, "delta": 1e-6}, "FAIL"),
        ({"min_accuracy": 0.999}, "FAIL"),
        ({"max_attack_auc": 0.5}, "INCONCLUSIVE"),
        ({"max_epsilon": 1000, "max_tpr_at_0_1pct_fpr": 1.0}, "INCONCLUSIVE"),
        ({"min_accuracy": 0.999, "max_tpr_at_0_1pct_fpr": 1.0}, "FAIL"),
    ],
    ids=["all-pass", "epsilon", "smaller-delta", "accuracy", "auc", "tpr-unresolvable", "fail-beats-inconclusive"],
)
def test_policy_gives_pass_fail_inconclusive_and_exit_code(audited, tmp_path, cli, limits, verdict):
    policy = tmp_path / "policy.yaml"
    policy.write_text("".join(f"{key}: {value}\n" for key, value in limits.items()))
    result = cli("report", audited, "--out", tmp_path / "r.md", "--policy", policy)
    assert result.exit_code == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 3}[verdict], result.output
    summary = read_json(tmp_path / "summary.json")
    checks = summary["runs"][0]["policy"]
    assert {c["limit"] for c in checks} == set(limits) - {"delta"}
    assert summary["verdict"] == verdict
    assert all(c["verdict"] == "PASS" for c in checks) == (verdict == "PASS")
    assert f"Policy: {verdict}" in result.output
    assert f"**{verdict}**" in (tmp_path / "r.md").read_text()


def test_tpr_the_sample_cannot_resolve_is_inconclusive_with_the_records_needed(audited, tmp_path, cli):
    """200 non-members (100 per half) cannot show an FPR of 0.1%: no PASS or FAIL, but how many records it would
    take."""
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_tpr_at_0_1pct_fpr: 0.5\n")
    result = cli("report", audited, "--out", tmp_path / "r.md", "--policy", policy)
    assert result.exit_code == 3, result.output
    (check,) = read_json(tmp_path / "summary.json")["runs"][0]["policy"]
    assert check["verdict"] == "INCONCLUSIVE" and check["value"] is None
    assert "not estimable from 100 non-members per half" in check["detail"] and "at least 1000" in check["detail"]


def test_an_auc_interval_that_straddles_the_limit_is_inconclusive(audited, tmp_path, cli):
    """A limit inside the AUC's 95% interval is neither met nor broken by this sample."""
    from fedaudit.reports.collect import collect_runs
    from fedaudit.reports.policy import Policy, check_run

    stored = read_json(audited / "attacks" / "loss-threshold-round-3" / "metrics.json")
    low, high = stored["auc_ci95"]
    assert high > 0.5  # an AUC limit is at least chance (a policy file with less is bad input)
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"max_attack_auc: {max((low + high) / 2, (0.5 + high) / 2)}\n")
    result = cli("report", audited, "--out", tmp_path / "r.md", "--policy", policy)
    assert result.exit_code == 3, result.output
    (check,) = read_json(tmp_path / "summary.json")["runs"][0]["policy"]
    assert check["verdict"] == "INCONCLUSIVE" and "per side would resolve it" in check["detail"]
    policy.write_text(f"max_attack_auc: {high + 0.001}\n")
    assert cli("report", audited, "--out", tmp_path / "r.md", "--policy", policy, "--overwrite").exit_code == 0
    assert read_json(tmp_path / "summary.json")["verdict"] == "PASS"
    (run,) = collect_runs([audited])  # below the interval: a limit no policy file may set here, judged directly
    assert {c.verdict for c in check_run(Policy(max_attack_auc=low - 0.001), run)} == {"FAIL"}


def test_missing_attacks_and_no_dp_are_explained_not_invented(plain_run, tmp_path, cli):
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_epsilon: 10\nmax_attack_auc: 0.6\n")
    result = cli("report", plain_run, "--out", tmp_path / "report.html", "--policy", policy)
    assert result.exit_code == 1, result.output
    run = read_json(tmp_path / "summary.json")["runs"][0]
    assert run["attacks"] == [] and run["privacy"]["epsilon"] is None and run["privacy"]["epsilon_infinite"]
    missing = " ".join(note["what"] + " " + note["how"] for note in run["missing"])
    assert f"fedaudit attack {plain_run}" in missing and "epsilon is infinite" in missing
    html = (tmp_path / "report.html").read_text()
    assert "No DP guarantee: epsilon is infinite" in html and f"fedaudit attack {plain_run}" in html
    assert [c["detail"].split(":")[0] for c in run["policy"]] == ["no DP guarantee", "not available"]


def test_several_runs_are_compared(audited, plain_run, tmp_path, cli):
    result = cli("report", audited, plain_run, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    html = (tmp_path / "report.html").read_text()
    assert '<h2 id="comparison">Comparison</h2>' in html
    assert "ROC curves of the strongest attack on each run" in html and "Privacy-utility trade-off" in html
    rows = pd.read_csv(tmp_path / "summary.csv")
    assert list(rows["path"]) == [str(audited), str(plain_run)]
    assert rows["dp"].tolist() == [True, False] and math.isnan(rows["attack_auc"][1])


def test_comparison_pdf_lays_out_without_split_words_or_blank_pages(audited, plain_run, tmp_path, cli):
    """Look at the PDF as a reader would: table headers keep their words whole, and no page but the last is mostly
    empty (sections flow on instead of starting new pages)."""
    pdftoppm, pdftotext = binary("pdftoppm"), binary("pdftotext")
    pango()
    result = cli("report", audited, plain_run, "--out", tmp_path / "report.pdf")
    assert result.exit_code == 0, result.output
    text = subprocess.run([pdftotext, tmp_path / "report.pdf", "-"], check=True, capture_output=True, text=True).stdout
    words = set(text.split())
    for header in ("algorithm", "privacy", "rounds", "epsilon", "attack", "members"):
        assert header in words, header
    for fragment in ("algorith", "epsilo", "roun", "ru"):
        assert fragment not in words, fragment
    subprocess.run(
        [pdftoppm, "-r", "30", "-gray", "-png", tmp_path / "report.pdf", tmp_path / "page"], check=True, timeout=60
    )
    pages = sorted(tmp_path.glob("page*.png"))
    assert len(pages) >= 2
    for page in pages[:-1]:
        rows = np.asarray(Image.open(page).convert("L")) < 200
        inked = int(rows.any(axis=1).sum())
        assert inked > 0.6 * 0.85 * rows.shape[0], (page.name, inked, rows.shape[0])  # 85%: the printable height


def test_fedlap_run_shows_its_synthetic_images(trained, tmp_path, cli):
    run = trained(*LAP_ARGS)
    result = cli("report", run, "--out", tmp_path / "lap.html")
    assert result.exit_code == 0, result.output
    html = (tmp_path / "lap.html").read_text()
    assert "Transmitted synthetic images" in html and "R_i * L * R_b" in html
    assert all(f"Round {n}: the synthetic sets of every client" in html for n in (1, 2))
    assert read_json(tmp_path / "summary.json")["runs"][0]["setup"]["algorithm"] == "FedLAP-DP"


def test_attack_results_of_format_1_or_with_missing_keys_are_tolerated(audited, tmp_path, cli):
    """Format 1 stored bare TPR numbers and a bound without its test; absent numbers read as "not available", and
    keys that no fedaudit ever wrote are not guessed at."""
    run = tmp_path / "run"
    shutil.copytree(audited, run, ignore=shutil.ignore_patterns("attacks"))
    old = run / "attacks" / "loss-custom"
    old.mkdir(parents=True)
    (old / "metrics.json").write_text(
        json.dumps(
            {
                "format_version": 1,
                "signal": "loss",
                "method": "custom",
                "auc": 0.61,
                "auc_ci95": [0.55, 0.67],
                "tpr_at_fpr": {"0.01": 0.02},
                "epsilon_lower_bound": 0.4,
                "auc_ci": [0.1, 0.2],
            }
        )
    )
    (old / "roc.csv").write_text("fpr,tpr,threshold\n0,0,inf\n0.5,0.7,0.1\n1,1,-inf\n")
    rehash(run)  # results an older fedaudit wrote, recorded as such
    result = cli("report", run, "--out", tmp_path / "out.md")
    assert result.exit_code == 0, result.output
    attack = read_json(tmp_path / "summary.json")["runs"][0]["attacks"][0]
    assert attack["auc_ci"] == [0.55, 0.67] and attack["tpr_at_1pct_fpr"]["tpr"] == 0.02
    assert attack["tpr_at_1pct_fpr"]["ci"] is None and attack["tpr_at_0_1pct_fpr"] is None
    assert attack["epsilon_lower_bound"] is None  # not a valid bound: left out with a note
    markdown = (tmp_path / "out.md").read_text()
    assert (
        "| loss/custom | not available | not available / not available | 0.610 | [0.550, 0.670] | 0.020 | "
        "not available |" in markdown
    )
    assert "older fedaudit" in markdown


@pytest.mark.parametrize(
    "case",
    [
        "not-a-run", "missing-run", "unknown-format", "missing-policy", "bad-yaml", "unknown-limit",
        "non-numeric-limit", "auc-above-1", "auc-below-chance", "delta-1.5", "delta-0", "negative-epsilon",
        "zero-epsilon", "rate-above-1", "negative-rate", "accuracy-above-1", "negative-ratio", "negative-count",
    ],
)  # fmt: skip
def test_bad_input_is_one_sentence_exit_2_and_writes_nothing(audited, tmp_path, cli, case):
    out = tmp_path / "out"
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        {
            "bad-yaml": "max_epsilon: [1\n",
            "unknown-limit": "max_epsilom: 1\n",
            "non-numeric-limit": "max_epsilon: lots\n",
            "auc-above-1": "max_attack_auc: 2\n",
            "auc-below-chance": "max_attack_auc: 0.4\n",
            "delta-1.5": "max_epsilon: 8\ndelta: 1.5\n",
            "delta-0": "max_epsilon: 8\ndelta: 0\n",
            "negative-epsilon": "max_epsilon: -1\n",
            "zero-epsilon": "max_epsilon: 0\n",
            "rate-above-1": "max_tpr_at_0_1pct_fpr: 1.2\n",
            "negative-rate": "max_tpr_at_1pct_fpr_per_client: -0.1\n",
            "accuracy-above-1": "min_accuracy: 95\n",
            "negative-ratio": "max_audit_ratio: -0.5\n",
            "negative-count": "max_failed_conformance_checks: -1\n",
        }.get(case, "max_epsilon: 8\n")
    )
    args = {
        "not-a-run": [tmp_path, "--out", out],
        "missing-run": [tmp_path / "nowhere", "--out", out],
        "unknown-format": [audited, "--out", out, "--format", "docx"],
        "missing-policy": [audited, "--out", out, "--policy", tmp_path / "absent.yaml"],
    }.get(case, [audited, "--out", out, "--policy", policy])
    result = cli("report", *args)
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ")
    assert not out.exists()


def test_synthetic_images_of_a_long_run_are_shown_for_evenly_spaced_rounds(tmp_path):
    import torch

    from fedaudit.reports.collect import SYNTHETIC_ROUNDS, _synthetic
    from fedaudit.rundir import RunDirectory

    run = RunDirectory(tmp_path)
    for number in range(1, 9):
        for client in range(2):
            run.wire.save(
                number, client, {"images": torch.full((2, 1, 4, 4), float(number)), "labels": torch.tensor([0, 1])}
            )
    sets = _synthetic(run)
    assert SYNTHETIC_ROUNDS == 6 and sorted({s.round for s in sets}) == [1, 2, 4, 5, 7, 8]
    assert [(s.round, s.client) for s in sets[:2]] == [(1, 0), (1, 1)] and all(
        s.images[0, 0, 0, 0] == s.round for s in sets
    )


def test_a_run_given_twice_is_reported_once(audited, tmp_path, cli):
    result = cli("report", audited, str(audited) + "/", "--out", tmp_path / "r.md")
    assert result.exit_code == 0, result.output
    assert len(read_json(tmp_path / "summary.json")["runs"]) == 1


def test_a_policy_delta_fails_a_run_whose_delta_is_unknown():
    from fedaudit.reports.collect import PrivacySummary, RunSummary
    from fedaudit.reports.policy import Policy, check_run

    run = RunSummary(
        "r",
        Path("r"),
        {"algorithm": "DP-FedAvg", "privacy budget": "sigma 1"},
        pd.DataFrame(),
        PrivacySummary(dp=True, delta=None, epsilon_per_round=(1.0,)),
        (),
        (),
        (),
    )
    (check,) = check_run(Policy(max_epsilon=8.0, delta=1e-5), run)
    assert not check.passed and "not recorded" in check.detail
    (check,) = check_run(Policy(max_epsilon=8.0), run)
    assert check.passed


def test_verdicts_on_intervals_and_the_records_that_would_resolve_them():
    from fedaudit.reports.policy import FAIL, INCONCLUSIVE, PASS, judge, records_needed

    assert judge((0.50, 0.60), 0.60, at_most=True) == PASS
    assert judge((0.61, 0.70), 0.60, at_most=True) == FAIL
    assert judge((0.55, 0.65), 0.60, at_most=True) == INCONCLUSIVE
    assert judge((0.70, 0.80), 0.70, at_most=False) == PASS
    assert judge((0.60, 0.69), 0.70, at_most=False) == FAIL
    assert judge((0.65, 0.75), 0.70, at_most=False) == INCONCLUSIVE
    # half-width 0.05 at n = 400; resolving a distance of 0.03 needs (0.05 / 0.03)^2 times the records
    assert records_needed(400, (0.50, 0.60), 0.55, 0.58) == 1112
    assert records_needed(400, (0.50, 0.60), 0.58, 0.58) is None
    # an interval that is not symmetric: the side facing the limit decides (0.02 of 0.03 at n = 400)
    assert records_needed(400, (0.52, 0.60), 0.55, 0.53) == 900


def _clopper_pearson_records(n: int, rate: float, limit: float) -> int:
    """The fewest m > n whose two-sided 95% Clopper-Pearson interval at round(rate m) successes excludes ``limit``,
    one m after another (scipy's beta quantiles, the interval's definition; rate m successes)."""
    from scipy.stats import beta

    m = n + 1
    while True:
        k = rate * m  # the same rate: successes need not be whole here
        low = beta.ppf(0.025, k, m - k + 1) if k > 0 else 0.0
        high = beta.ppf(0.975, k + 1, m - k) if k < m else 1.0
        if (high < limit) if rate < limit else (low > limit):
            return m
        m += 1


@pytest.mark.parametrize(
    "n, successes, limit",
    [(71, 0, 0.05), (73, 1, 0.05), (200, 190, 0.93), (400, 300, 0.72), (50, 50, 0.97), (1000, 14, 0.02)],
)
def test_the_records_a_rate_needs_are_those_at_which_its_clopper_pearson_interval_excludes_the_limit(
    n: int, successes: int, limit: float
) -> None:
    """A TPR of 0 of 71 members against a limit of 0.05 was said to need "about 19 per side" (the interval's
    half-width scaled as if symmetric): near 0 and 1 the interval is lopsided and narrows as 1/n."""
    from fedaudit.attacks.metrics import rate_interval
    from fedaudit.reports.policy import records_needed

    rate = successes / n
    interval = tuple(rate_interval(successes, n))
    assert interval[0] <= limit <= interval[1]  # inconclusive at n
    assert records_needed(n, interval, rate, limit, proportion=True) == _clopper_pearson_records(n, rate, limit)


def test_accuracy_is_judged_on_its_interval_over_the_test_split():
    from fedaudit.reports.collect import PrivacySummary, RunSummary
    from fedaudit.reports.policy import Policy, check_run

    def run(accuracy: float, test_records: int) -> RunSummary:
        utility = pd.DataFrame({"round": [1], "test_accuracy": [accuracy]})
        return RunSummary(
            "r",
            Path("r"),
            {"algorithm": "FedAvg", "privacy budget": "no DP"},
            utility,
            PrivacySummary(dp=False),
            (),
            (),
            (),
            test_records=test_records,
        )

    # 0.72 on 360 records: 95% interval about [0.67, 0.77]
    assert [check_run(Policy(min_accuracy=limit), run(0.72, 360))[0].verdict for limit in (0.6, 0.7, 0.8)] == [
        "PASS",
        "INCONCLUSIVE",
        "FAIL",
    ]
    (check,) = check_run(Policy(min_accuracy=0.7), run(0.72, 360))
    assert "on 360 test records" in check.detail and "test records would resolve it" in check.detail
    assert check_run(Policy(min_accuracy=0.7), run(0.72, 100000))[0].verdict == "PASS"


def _attack(name: str, auc: float, ci: tuple[float, float], bound_test: dict | None = None):
    from fedaudit.reports.collect import AttackSummary

    return AttackSummary(
        name,
        name,
        "threshold",
        3,
        auc,
        ci,
        None,
        None,
        None,
        None,
        0.0,
        2.0,
        1000,
        1000,
        0,
        auc_se=(ci[1] - ci[0]) / 3.92,
        epsilon_lower_bound_test=bound_test,
    )


def _run_with(*attacks):
    from fedaudit.reports.collect import PrivacySummary, RunSummary

    return RunSummary(
        "r",
        Path("r"),
        {"algorithm": "DP-FedAvg", "privacy budget": "sigma 1", "rounds done": 3},
        pd.DataFrame(),
        PrivacySummary(dp=True, delta=1e-5, epsilon_per_round=(2.0,)),
        attacks,
        (),
        (),
    )


def test_auc_fails_only_on_an_interval_simultaneous_over_the_attacks():
    """One of eight attacks just above the limit by its own 95% interval is what chance gives; FAIL needs the
    interval that holds for all eight at once."""
    from fedaudit.reports.policy import Policy, check_run

    others = [_attack(f"a{i}", 0.50, (0.48, 0.52)) for i in range(7)]
    edge = _attack("edge", 0.545, (0.525, 0.565))  # marginal lower end above 0.52; simultaneous (8) below it
    (check,) = check_run(Policy(max_attack_auc=0.52), _run_with(edge, *others))
    assert check.verdict == "INCONCLUSIVE" and "simultaneous over the 8 attacks" in check.detail
    (check,) = check_run(Policy(max_attack_auc=0.52), _run_with(edge))
    assert check.verdict == "FAIL"  # alone, its own interval decides
    far = _attack("far", 0.60, (0.58, 0.62))
    (check,) = check_run(Policy(max_attack_auc=0.52), _run_with(far, *others))
    assert check.verdict == "FAIL"


def test_run_bound_over_several_attacks_is_bonferroni_corrected():
    """The run's headline bound is the largest of its attacks' bounds, each recomputed at 1 - 0.05/K from its counts."""
    from fedaudit.attacks.metrics import threshold_bounds

    test = {
        "threshold": 0.3,
        "inequality": "tpr",
        "true_positives": 300,
        "false_positives": 20,
        "bound_members": 1000,
        "bound_nonmembers": 1000,
        "delta": 1e-5,
    }
    alone, _ = _run_with(_attack("a", 0.6, (0.57, 0.63), test)).epsilon_lower_bound()
    four, k = _run_with(*[_attack(f"a{i}", 0.6, (0.57, 0.63), test) for i in range(4)]).epsilon_lower_bound()
    expected = threshold_bounds(np.array([300]), np.array([20]), 1000, 1000, delta=1e-5, confidence=1 - 0.05 / 4)["tpr"]
    assert k == 4 and four == pytest.approx(float(expected[0])) and 0 < four < alone
    legacy = _attack("old", 0.6, (0.57, 0.63))  # no recorded test: an older, invalid bound, left out
    assert _run_with(legacy).epsilon_lower_bound() == (None, 0)


def test_the_broken_dp_warning_needs_a_corrected_bound_above_the_accountant():
    """A planted leak far beyond the accountant's epsilon is reported; a bound that clears it only at its own 95%,
    not at the confidence corrected for the run's attacks, is not."""
    from fedaudit.reports.render import _exceeds

    def attack(name: str, true_positives: int, accountant: float):
        test = {
            "threshold": 0.3,
            "inequality": "tpr",
            "true_positives": true_positives,
            "false_positives": 1,
            "bound_members": 1000,
            "bound_nonmembers": 1000,
            "delta": 1e-5,
        }
        return replace(_attack(name, 0.6, (0.57, 0.63), test), accountant_epsilon=accountant)

    leak = attack("leak", 900, 0.5)
    assert _exceeds(_run_with(leak))["attack"] == "leak" and _exceeds(_run_with(leak))["bound"] > 4
    edge = attack("edge", 30, 0.0)
    alone = edge.epsilon_bound_at(0.95)
    edge = replace(edge, accountant_epsilon=alone - 0.05)  # above the accountant by its own 95% bound only
    assert _exceeds(_run_with(edge)) is not None
    assert _exceeds(_run_with(edge, *[attack(f"a{i}", 0, 10.0) for i in range(9)])) is None


def _risky_attack(leaky_client: int | None, seed: int = 0):
    """An attack on 5 clients' members (2000 each side, half choosing the threshold); ``leaky_client``'s members
    score far above everyone else's."""
    from fedaudit.attacks.metrics import risk

    rng = np.random.default_rng(seed)
    n = 4000
    member = (np.arange(n) < n // 2).astype(int)
    client = np.where(member == 1, np.arange(n) % 5, -1)
    label = rng.integers(0, 10, n)
    score = rng.normal(size=n)
    if leaky_client is not None:
        score[client == leaky_client] += 4.0
    select = rng.permutation(n) < n // 2
    table = risk(
        member, score, report=~select, select=select, client=client, label=label, record=np.arange(n),
        source=np.full(n, "train"),
    )  # fmt: skip
    return replace(_attack("loss", 0.55, (0.53, 0.57)), risk=table)


def test_a_leaky_client_fails_the_per_client_limit_and_a_fair_run_passes():
    from fedaudit.reports.policy import Policy, check_run

    policy = Policy(max_tpr_at_1pct_fpr_per_client=0.2)
    (fair,) = check_run(policy, _run_with(_risky_attack(None, seed=1)))
    assert fair.verdict == "PASS", fair.detail
    (leaky,) = check_run(policy, _run_with(_risky_attack(3, seed=1)))
    assert leaky.verdict == "FAIL" and "client 3" in leaky.detail
    # Seed 0's threshold, chosen on 1000 non-members, lands at FPR 0.026 [0.017, 0.038] on the other 1000: its TPR
    # is not a rate at 1% FPR, so the limit cannot be judged on it.
    (unresolved,) = check_run(policy, _run_with(_risky_attack(None, seed=0)))
    assert unresolved.verdict == "INCONCLUSIVE" and "reached FPR 0.026 " in unresolved.detail
    (missing,) = check_run(policy, _run_with(_attack("loss", 0.5, (0.48, 0.52))))
    assert missing.verdict == "FAIL" and "not available" in missing.detail


def test_a_canary_audit_stands_in_the_comparison_and_every_number_says_what_it_is(audited, plain_run, tmp_path, cli):
    """A canary-only run beside two attacked runs: its audit's bound and AUC interval are in the comparison table and
    summary.csv; the one advantage shown is the held-out one with its interval; a run without DP reads "no DP" in
    every epsilon and delta cell."""
    canary = tmp_path / "canary"
    assert cli("train", *FAST_ARGS, "--dp", "--rounds", "2", "--canaries", "300", "--out", canary).exit_code == 0
    assert cli("attack", canary, "--method", "canary").exit_code == 0
    result = cli("report", canary, audited, plain_run, "--out", tmp_path / "r", "--format", "md")
    assert result.exit_code == 0, result.output
    rows = pd.read_csv(tmp_path / "r" / "summary.csv")
    audits = {m["signal"]: m for m in (read_json(p) for p in (canary / "attacks").glob("*-canary/metrics.json"))}
    best = max(audits.values(), key=lambda m: (m["epsilon_lower_bound"], m["auc_ci95"][0]))
    first = rows.iloc[0]
    assert first["canary_view"] == best["signal"] and first["canary_epsilon_lower_bound"] == pytest.approx(
        best["epsilon_lower_bound"]
    )
    assert (first["canary_auc_ci_low"], first["canary_auc_ci_high"]) == pytest.approx(tuple(best["auc_ci95"]))
    assert rows["canary_view"][1:].isna().all()
    assert "advantage" not in rows.columns  # only the held-out one, with its interval
    strongest = read_json(tmp_path / "r" / "summary.json")["runs"][1]["strongest_attack"]
    held_out = read_json(audited / "attacks" / strongest / "metrics.json")["advantage_held_out"]
    second = rows.iloc[1]
    assert second["advantage_held_out"] == pytest.approx(held_out["advantage"])
    assert second["advantage_held_out_ci_low"] == pytest.approx(held_out["ci95"][0])
    markdown = (tmp_path / "r" / "report.md").read_text()
    table = markdown.split("## Comparison", 1)[1].split("\n## ", 1)[0]
    header = next(line for line in table.splitlines() if line.startswith("| run"))
    assert "canary audit bound" in header and "canary AUC [95%]" in header and "advantage, held-out [95%]" in header
    canary_row = next(line for line in table.splitlines() if line.startswith("| canary |"))
    assert (
        f"({best['signal']})" in canary_row and f"[{best['auc_ci95'][0]:.3f}, {best['auc_ci95'][1]:.3f}]" in canary_row
    )
    plain_row = next(line for line in table.splitlines() if "| FedAvg | no DP |" in line)
    assert plain_row.count("| no DP |") >= 2 and "infinite" not in plain_row  # epsilon and delta, one word
    assert "infinite" not in markdown.split("## Run", 1)[0]


def _groups(*entries):
    """Groups as group_rows makes them: (algorithm, budget, runs, accuracies of its seeds, interval of one run)."""
    rows = []
    for algorithm, budget, accuracies, one in entries:
        values = np.array(accuracies, dtype=float)
        rows.append(
            {
                "algorithm": algorithm,
                "budget": budget,
                "runs": len(values),
                "final_accuracy_mean": values.mean(),
                "final_accuracy_std": values.std(ddof=1) if len(values) > 1 else np.nan,
                "final_accuracy_n": len(values),
                "final_accuracy_interval_low": one[0] if one else np.nan,
                "final_accuracy_interval_high": one[1] if one else np.nan,
            }
        )
    return pd.DataFrame(rows)


def test_the_comparison_states_the_ordering_with_intervals_and_when_it_is_not_the_papers():
    from scipy.stats import t

    from fedaudit.reports.summary import findings

    no_attacks = pd.DataFrame({"dp": [True], "attack_auc": [np.nan]})
    groups = _groups(
        ("FedLAP-DP", "epsilon 2", [0.30, 0.34, 0.32], None),
        ("DP-FedAvg", "epsilon 2", [0.77, 0.78, 0.79], None),
        ("FedLAP-DP", "epsilon 8", [0.70], (0.60, 0.80)),
        ("DP-FedAvg", "epsilon 8", [0.75], (0.65, 0.85)),
    )
    said = findings(no_attacks, groups)
    half = t.ppf(0.975, 2) * 0.01 / math.sqrt(3)  # Student's t over three seeds, sd 0.01
    first = next(s for s in said if s.startswith("Test accuracy at epsilon 2"))
    assert f"DP-FedAvg 0.780 [{0.78 - half:.3f}, {0.78 + half:.3f}] > FedLAP-DP 0.320" in first
    assert "every interval apart" in first
    (why,) = [s for s in said if "opposite of the ordering" in s]
    assert why.startswith("At epsilon 2 FedLAP-DP is below DP-FedAvg with the intervals apart (and its mean is below")
    assert "at epsilon 8, where the intervals overlap)" in why  # overlapping intervals order nothing
    eight = next(s for s in said if s.startswith("Test accuracy at epsilon 8"))
    assert "DP-FedAvg 0.750 [0.650, 0.850] > FedLAP-DP 0.700 [0.600, 0.800]" in eight and "cannot order" in eight
    rows = pd.DataFrame({"dp": [True, True], "attack_auc": [np.nan] * 2, "algorithm": ["FedLAP-DP", "DP-FedAvg"]})
    rows["sample_rate"] = [0.14, 0.14]
    overlapping = findings(rows, groups[groups["budget"] == "epsilon 8"])
    (why,) = [s for s in overlapping if "opposite of the ordering" in s]
    assert why.startswith("FedLAP-DP's mean accuracy is below DP-FedAvg's at epsilon 8, though the intervals overlap")
    assert "here a query samples q = 0.140 of a client's records (B / N_k)" in why
    ahead = groups.assign(final_accuracy_mean=[0.9, 0.8, 0.9, 0.8])
    assert not any("opposite" in s for s in findings(no_attacks, ahead))


def test_a_study_that_cannot_tell_dp_from_no_dp_says_so_and_how_many_records_would():
    from fedaudit.reports.summary import findings

    rows = pd.DataFrame(
        {
            "dp": [True, False],
            "attack_auc": [0.50, 0.52],
            "attack_auc_simultaneous_ci_low": [0.45, 0.47],
            "attack_members": [300, 300],
            "attack_nonmembers": [300, 300],
        }
    )
    groups = _groups(("DP-FedAvg", "epsilon 8", [0.7], (0.6, 0.8)), ("FedAvg", "no DP", [0.9], (0.85, 0.95)))
    said = findings(rows, groups)
    sentence = next(s for s in said if "cannot tell DP from no DP" in s)
    assert f"about {math.ceil((1.96 / 0.02) ** 2 / 6)} members" in sentence and "(these attacks had 300)" in sentence
    leaky = rows.assign(attack_auc_simultaneous_ci_low=[0.45, 0.51])
    assert not any("cannot tell" in s for s in findings(leaky, groups))


def test_a_report_is_replaced_only_with_overwrite(plain_run, tmp_path):
    out = tmp_path / "r.md"
    assert invoke("report", plain_run, "--out", out).exit_code == 0
    out.write_text("kept")
    result = invoke("report", plain_run, "--out", out)
    assert result.exit_code == 2 and "pass --overwrite" in result.stderr
    assert out.read_text() == "kept"
    assert invoke("report", plain_run, "--out", out, "--overwrite").exit_code == 0
    assert out.read_text().startswith("# ")


def test_markup_in_names_and_sources_stays_text_in_markdown(plain_run, tmp_path):
    """A run directory named with HTML, and a dataset source with a pipe and a tag, cannot inject markup or break a
    table row of the Markdown report."""
    run = tmp_path / "<img src=x onerror=alert(1)>"
    shutil.copytree(plain_run, run)
    out = tmp_path / "r.md"
    assert invoke("report", run, "--out", out).exit_code == 0
    markdown = out.read_text()
    assert "&lt;img src=x onerror=alert(1)&gt;" in markdown  # in prose: as entities
    assert "`<img src=x onerror=alert(1)>`" in markdown  # in a code span: literal, as Markdown shows it
    import markdown as python_markdown
    from markdown_it import MarkdownIt

    for html in (
        python_markdown.markdown(markdown, extensions=["tables"]),
        MarkdownIt().enable("table").render(markdown),
    ):
        assert "<img" not in html and "&amp;lt;" not in html, html
        assert "<code>&lt;img src=x onerror=alert(1)&gt;</code>" in html


def test_an_auc_check_above_its_limit_counts_the_records_of_the_interval_a_fail_needs():
    """A FAIL of max_attack_auc is judged on the interval simultaneous over the K attacks: the records that would
    resolve an AUC above the limit come from that interval (146 per side were said where about 243 are needed); one
    below the limit is resolved by its own interval, which a PASS reads."""
    from types import SimpleNamespace

    from scipy.stats import norm

    from fedaudit.reports.collect import AttackSummary
    from fedaudit.reports.policy import INCONCLUSIVE, _auc

    def attack(auc: float, low: float, high: float) -> AttackSummary:
        return AttackSummary(
            "loss-threshold",
            "loss",
            "threshold",
            None,
            auc,
            (low, high),
            None,
            None,
            None,
            None,
            None,
            None,
            144,
            144,
            0,
            auc_se=0.034,
        )

    above, below = attack(0.5655, 0.4997, 0.6304), attack(0.49, 0.43, 0.55)
    run = SimpleNamespace(final_attacks=[above, below, below, below], attacks=[], rounds_done=1)
    value, verdict, detail = _auc(None, run, 0.5)
    assert verdict == INCONCLUSIVE
    z = norm.ppf(1 - 0.05 / (2 * 4))  # the simultaneous interval's, over four attacks
    needed = math.ceil(144 * (z * 0.034 / (0.5655 - 0.5)) ** 2)
    assert f"AUC 0.5655 [0.4997, 0.6304], n=144/144 (about {needed} per side would resolve it)" in detail
    own = math.ceil(144 * ((0.55 - 0.49) / (0.5 - 0.49)) ** 2)  # below the limit: the attack's own interval
    assert f"AUC 0.4900 [0.4300, 0.5500], n=144/144 (about {own} per side would resolve it)" in detail


def test_a_run_of_many_rounds_is_reported_in_kilobytes(plain_run, tmp_path):
    """A metrics.csv of a quarter of a gigabyte (3 million rounds, under the 256 MiB bound) took 3.7 GB and wrote a
    report of 223 MB: the report shows 200 rounds, evenly spaced, first and last included, and says so."""
    from helpers import rehash

    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    rounds = 50_000
    frame = pd.DataFrame(
        {"round": range(1, rounds + 1), "test_accuracy": 0.5, "test_loss": 1.0, "epsilon": float("inf")}
    )
    frame.to_csv(run / "metrics.csv", index=False)
    rehash(run)
    result = invoke("report", run, "--out", tmp_path / "report", "--format", "md", "--format", "html")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    shown = summary["runs"][0]["utility"]["round"]
    assert len(shown) == 200 and shown[0] == 1 and shown[-1] == rounds
    assert "200 of the run's 50000 rounds are shown, evenly spaced" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "report.html").stat().st_size < 5 << 20


def test_the_threat_model_names_the_signals_the_attacks_read(audited, plain_run, tmp_path, cli):
    """The audited run was attacked with the loss alone: the threat model says so, and names no gradient norm; a run
    without attacks says nothing bounds its leakage from below."""
    assert cli("report", audited, "--out", tmp_path / "a.md").exit_code == 0
    threat = (tmp_path / "a.md").read_text().split("### Threat model", 1)[1].split("###", 1)[0]
    assert "score each record by the per-record loss (black-box);" in threat and "gradient norm" not in threat
    assert cli("report", plain_run, "--out", tmp_path / "b" / "b.md").exit_code == 0
    threat = (tmp_path / "b" / "b.md").read_text().split("### Threat model", 1)[1].split("###", 1)[0]
    assert "No membership attack has been run on this run yet" in threat and "per-record loss" not in threat


def test_a_dp_run_whose_ledger_is_missing_is_not_called_a_run_without_dp(audited, tmp_path, cli):
    run = Path(shutil.copytree(audited, tmp_path / "run"))
    (run / "privacy.json").unlink()
    assert cli("report", run, "--out", tmp_path / "r.md").exit_code == 1  # its files are not those fedaudit wrote
    text = (tmp_path / "r.md").read_text()
    assert "promises no differential privacy" not in text and "trained without differential privacy" not in text
    assert "was trained with DP, but its ledger privacy.json is missing" in text
    assert "without DP noise" not in text and "restore it from a copy of the run" in text
    assert "The unit protected" not in text and "what it protects and at what epsilon cannot be read" in text


def test_a_client_level_run_that_samples_every_client_claims_no_amplification(trained, tmp_path, cli):
    run = trained("--dp", "--dp-level", "client", "--max-update-norm", "0.5", "--rounds", "2")
    assert cli("report", run, "--out", tmp_path / "r.md").exit_code == 0
    text = (tmp_path / "r.md").read_text()
    assert "with amplification" not in text and "without amplification: every client takes part" in text
    row = pd.read_csv(tmp_path / "summary.csv").iloc[0]
    assert row["unit"] == "client" and row["max_update_norm"] == 0.5 and pd.isna(row["max_grad_norm"])
    assert row["sample_rate"] == 1.0


def test_a_simultaneous_interval_is_never_narrower_than_the_attack_s_own():
    """One attack: its own (bootstrap) interval. Several: the Bonferroni normal interval, widened where a skewed
    bootstrap interval reaches beyond it."""
    skewed = _attack("skewed", 0.512, (0.486, 0.552))  # auc_se from the width: the normal interval ends at 0.545
    assert skewed.simultaneous_ci(1) == (0.486, 0.552)
    for k in (2, 4, 8):
        low, high = skewed.simultaneous_ci(k)
        assert low <= 0.486 and high >= 0.552
    low, high = skewed.simultaneous_ci(8)
    assert low < 0.486 - 0.005 and high > 0.552  # eight attacks: wider than its own on both sides


def test_at_a_sigma_budget_each_epsilon_is_stated_and_a_cheaper_fedlap_says_nothing_of_the_paper():
    """sigma 1 is not one epsilon: FedLAP-DP below DP-FedAvg at half its epsilon is no evidence against the paper's
    ordering at equal epsilon; two settings of one algorithm are named by their groups."""
    from fedaudit.reports.summary import findings

    no_attacks = pd.DataFrame({"dp": [True], "attack_auc": [np.nan]})
    groups = _groups(
        ("DP-FedAvg", "sigma 1", [0.40], (0.35, 0.45)),
        ("DP-FedAvg", "sigma 1", [0.30], (0.25, 0.35)),
        ("FedLAP-DP", "sigma 1", [0.10], (0.05, 0.15)),
    ).assign(
        epsilon_mean=[5.376, 5.376, 2.723],
        group=["DP-FedAvg, sigma 1", "DP-FedAvg, sigma 1 (2)", "FedLAP-DP, sigma 1"],
    )
    (said,) = [s for s in findings(no_attacks, groups) if s.startswith("Test accuracy at sigma 1")]
    assert "DP-FedAvg, sigma 1 0.400 [0.350, 0.450] at epsilon 5.376 > DP-FedAvg, sigma 1 (2) 0.300" in said
    assert "FedLAP-DP 0.100 [0.050, 0.150] at epsilon 2.723" in said
    assert not any("opposite of the ordering" in s for s in findings(no_attacks, groups))
    richer = groups.assign(epsilon_mean=[5.376, 5.376, 6.0])  # FedLAP-DP spent more and is still below
    assert any("opposite of the ordering" in s for s in findings(no_attacks, richer))


def test_a_result_written_when_each_rate_was_at_95_percent_is_reported_at_the_bound_s_level(audited, tmp_path):
    """Attack results of format 2 bounded epsilon with each Clopper-Pearson rate at 95% (both together: 90%): the
    report recomputes the bound from its recorded test, as format 3 computes it."""
    from fedaudit.reports.collect import collect_runs

    run = Path(shutil.copytree(audited, tmp_path / "run"))
    path = run / "attacks" / "loss-threshold-round-3" / "metrics.json"
    metrics = read_json(path)
    (now,) = [a for a in collect_runs([audited])[0].attacks if a.name == "loss-threshold-round-3"]
    assert metrics["format_version"] == 3 and now.epsilon_lower_bound == metrics["epsilon_lower_bound"]
    path.write_text(json.dumps({**metrics, "format_version": 2, "epsilon_lower_bound": 99.0}))
    rehash(run)
    (old,) = [a for a in collect_runs([run])[0].attacks if a.name == "loss-threshold-round-3"]
    assert old.epsilon_lower_bound == pytest.approx(now.epsilon_lower_bound)


def test_the_threat_model_names_the_client_attack_and_leaves_canary_views_out():
    from fedaudit.reports.guarantee import attacks_sentence

    client = replace(_attack("loss-client", 0.6, (0.5, 0.7)), signal="loss", method="client", unit="client")
    canary = replace(_attack("query-sum-canary", 0.6, (0.5, 0.7)), signal="query-sum", method="canary")
    said = attacks_sentence(_run_with(client, canary))
    assert "score each client by its records' mean loss" in said and "query-sum" not in said
    assert "per-record loss" not in said
    said = attacks_sentence(_run_with(canary))
    assert said.startswith("No membership attack has been run") and "canary audit" in said
