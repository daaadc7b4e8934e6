"""The privacy guarantee as NIST SP 800-226 asks for it, and the attack families tried (EDPB Opinion 28/2024)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from helpers import invoke, read_json

from fedaudit.reports.collect import collect_runs
from fedaudit.reports.guarantee import (
    ASPECTS,
    NOT_APPLICABLE,
    NOT_RUN,
    RUN,
    coverage_table,
    guarantee_table,
    guarantees_table,
)


def _rows(frame) -> dict[str, list[str]]:
    return {row[0]: list(row[1:]) for row in frame.itertuples(index=False)}


def test_a_dp_runs_guarantee_states_every_parameter_and_delta_against_one_over_n(dp_run):
    (run,) = collect_runs([dp_run])
    rows = _rows(guarantee_table(run))
    ledger = read_json(dp_run / "privacy.json")
    records = sum(read_json(dp_run / "manifest.json")["clients"]["num_examples"])
    assert rows["unit of privacy"][0].startswith("one training record of one client")
    assert f"at delta {ledger['delta']:g}" in rows["privacy loss"][0]
    assert (
        f"n = {records} training records; delta is {(1 / records) / ledger['delta']:.0f} times smaller"
        in rows["delta against 1/n"][0]
    )
    assert "clipped to C = 1," in rows["mechanism"][0] and "sigma = 1," in rows["mechanism"][0]
    assert "3 rounds taken part in by the worst client" in rows["composition and conversion"][0]
    assert "this machine's operator" in rows["trust model"][0]
    assert rows["outside the guarantee"][0] == "each client's number of records, public in its sampling rate and steps"
    fedlap = _rows(guarantee_table(replace(run, algorithm="fedlap")))["outside the guarantee"][0]
    assert "each client's set of classes, the labels of its synthetic set" in fedlap
    deployed = replace(run, seedless_config=json.dumps({"flower": {"superlink": "127.0.0.1:9093"}}))
    assert rows != _rows(guarantee_table(deployed))
    assert "at its own site (a SuperNode)" in _rows(guarantee_table(deployed))["trust model"][0]


def test_the_trust_model_says_who_can_remove_the_noise(dp_run, tmp_path):
    (run,) = collect_runs([dp_run])
    own = _rows(guarantee_table(run))["trust model"][0]
    assert "own secret" in own and "whoever holds client-secrets.json (in this run directory) can remove" in own
    deployed = replace(run, seedless_config=json.dumps({"flower": {"superlink": "127.0.0.1:9093"}}))
    at_sites = _rows(guarantee_table(deployed))["trust model"][0]
    assert "a secret that only it holds (a file at the site, never sent)" in at_sites
    public = _rows(guarantee_table(replace(run, randomness="noise-seed")))["trust model"][0]
    assert "public --noise-seed" in public and "the server included, can remove it" in public
    old = _rows(guarantee_table(replace(run, randomness="run-seed")))["trust model"][0]
    assert "trained before fedaudit kept client secrets" in old
    assert "own secret" in run.setup["DP noise drawn from"]


def test_a_large_delta_is_called_out(dp_run):
    (run,) = collect_runs([dp_run])
    loose = replace(run, privacy=replace(run.privacy, delta=0.5 / run.records))
    assert "not much smaller than 1/n" in _rows(guarantee_table(loose))["delta against 1/n"][0]


def test_the_coverage_matrix_marks_what_was_run_not_run_or_not_applicable(plain_run, dp_run, tmp_path):
    attacked = Path(shutil.copytree(dp_run, tmp_path / "dp"))
    assert invoke("attack", attacked, "--no-progress", "--signal", "loss").exit_code == 0
    plain, dp = collect_runs([plain_run, attacked])
    dp_rows = _rows(coverage_table(dp))
    assert dp_rows["membership inference, black-box (loss, confidence)"] == [RUN, "loss/classifier, loss/threshold"]
    assert dp_rows["membership inference, white-box (gradient norm)"][0] == NOT_RUN
    assert dp_rows["canary audit of the DP mechanism (one-run epsilon bound)"][0] == NOT_RUN
    plain_rows = _rows(coverage_table(plain))
    assert plain_rows["canary audit and conformance of the DP mechanism"][0] == NOT_APPLICABLE
    assert plain_rows["membership inference, black-box (loss, confidence)"][0] == NOT_RUN
    assert all(status in (RUN, NOT_RUN, NOT_APPLICABLE) for status, _ in plain_rows.values())


def test_the_reports_guarantee_table_holds_every_runs_guarantee_once_and_merges_what_runs_share(plain_run, dp_run):
    plain, dp = collect_runs([plain_run, dp_run])
    twin = replace(dp, name=f"{dp.name}-twin")  # the same guarantee under another name: every row merged
    names = [plain.name, dp.name, twin.name]
    assert len(set(names)) == 3
    merged = list(guarantees_table([plain, dp, twin]).itertuples(index=False))
    expanded: dict[tuple[str, str], str] = {}
    for aspect, runs, text in merged:
        for name in names if runs == "every run" else runs.split(", "):
            assert (aspect, name) not in expanded, (aspect, name)
            expanded[(aspect, name)] = text
    own = {(a, run.name): t for run in (plain, dp, twin) for a, t in guarantee_table(run).itertuples(index=False)}
    assert expanded == own
    assert [aspect for aspect, runs, _ in merged if runs == "every run"] == ["not counted"]
    assert {runs for aspect, runs, _ in merged if runs != "every run"} <= {plain.name, f"{dp.name}, {twin.name}"}
    assert [aspect for aspect, *_ in merged] == sorted((a for a, *_ in merged), key=ASPECTS.index)
    assert {runs for aspect, runs, _ in merged if aspect == "privacy loss"} == {f"{dp.name}, {twin.name}"}
    assert "nothing protects a record" in own[("trust model", plain.name)]


def test_the_trust_model_of_noise_in_shares_says_whether_the_server_saw_them_summed(dp_run):
    """Client-level DP with the noise in shares: summed under SecAgg+ (a deployment, the clients' own secrets), the
    server is not trusted but assumed to follow the protocol; without a secure sum, or with a public noise seed,
    it is trusted, and the report never says both."""
    (run,) = collect_runs([dp_run])
    shares = replace(run.privacy, unit="client", noise_at="clients", max_update_norm=1.0, clients=5)
    deployed = json.dumps({"flower": {"superlink": "127.0.0.1:9093"}})
    summed = replace(run, privacy=replace(shares, secure_sum=True), seedless_config=deployed)
    trust = _rows(guarantee_table(summed))["trust model"][0]
    assert "summed under Flower's SecAgg+" in trust and "honest but curious" in trust
    assert "number of examples, local steps and data fingerprint" in trust
    local = _rows(guarantee_table(replace(run, privacy=shares)))["trust model"][0]
    assert "this engine runs no secure aggregation" in local and "not against the server" in local
    public = _rows(guarantee_table(replace(summed, privacy=shares, randomness="noise-seed")))["trust model"][0]
    assert "public --noise-seed" in public and "the server is trusted" in public and "SecAgg+" not in public
    central = replace(run, privacy=replace(shares, noise_at="server"))
    for table, norms in ((guarantee_table(summed), False), (guarantee_table(central), True)):
        outside = _rows(table)["outside the guarantee"][0]  # the server sees no norm when the noise comes in shares
        assert "each round's sample of clients (the checkpoints' round-NNNN.json, server-metrics.csv)" in outside
        assert ("their median norm, computed before the noise" in outside) == norms


def test_a_report_over_runs_of_different_datasets_says_so_first(plain_run, dp_run):
    """Runs of one dataset are compared without the sentence; a run of another dataset beside them is named, with the
    dataset of each run, before any ordering of their accuracies."""
    from fedaudit.reports.summary import findings, group_rows, summary_rows

    plain, dp = collect_runs([plain_run, dp_run])
    rows = summary_rows([plain, dp], {})
    assert not any("different datasets" in s for s in findings(rows, group_rows(rows)))
    other = replace(dp, name="fm", setup={**dp.setup, "dataset": "fashion-mnist"})
    rows = summary_rows([plain, dp, other], {})
    first = findings(rows, group_rows(rows))[0]
    assert first.startswith("These runs were trained on different datasets (")
    assert f"{plain.setup['dataset']}: {plain.name}, {dp.name}; fashion-mnist: fm" in first
