"""The audit of a Flower canary log, on logs made here (the Flower app itself: tests/fedaudit/test_flower_canaries.py):
the log's format and its refusals, each view's score, the estimators against closed forms, the accountant against
Google's dp-accounting and the closed form of the Gaussian mechanism, a null over many seeds, and the results folder
recomputed from its own files."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fedaudit.attacks import AttackError
from fedaudit.attacks.canary.estimators import epsilon_from_gdp, epsilon_one_run, gdp_epsilon
from fedaudit.attacks.canary.flower_log import LEVEL, accountant_epsilon, audit, audit_log, view_scores, write_results
from fedaudit.instruments.canary_log import FORMAT, CanaryLog, CanaryLogError, read_log
from fedaudit.privacy.accounting import SGMEvent, calibrate_noise_multiplier, compute_epsilon

DELTA = 1e-5


def make_log(
    *,
    seed: int = 0,
    canaries: int = 200,
    rounds: int = 4,
    shift: float = 0.0,
    sd: float = 0.02,
    sigma: float = 1.0,
    sampled: int = 20,
    population: int = 200,
    mechanism: str = "central DP, server-side clipping",
) -> CanaryLog:
    """A log whose cosines are Gaussian: excluded canaries N(0, sd^2), included ones N(shift * sd, sd^2), in every
    round and in the final model."""
    rng = np.random.default_rng(seed)
    included = (rng.random(canaries) < 0.5).astype(np.int8)
    mean = shift * sd * included
    return CanaryLog(
        seed=seed,
        included=included,
        scale=10.0,
        clipping_norm=0.1,
        noise_multiplier=sigma,
        mechanism=mechanism,
        strategy="DifferentialPrivacyServerSideFixedClipping(FedAvg)",
        dimension=2500,
        delta=DELTA,
        round_cosines=np.clip(rng.normal(mean, sd, (rounds, canaries)), -1, 1),
        round_norms=np.ones(rounds),
        released=np.ones(rounds, dtype=np.int8),
        sampled=np.full(rounds, sampled),
        population=np.full(rounds, population),
        equal_weights=np.ones(rounds, dtype=np.int8),
        final_cosines=np.clip(rng.normal(mean, sd), -1, 1),
        final_norm=1.0,
        sample_rate=np.full(rounds, math.nan),
        flower_epsilon=math.nan,
        flower_delta=math.nan,
        flower_report="Flower reports no epsilon.",
        flower_version="1.41.0",
        fedaudit_version="0.1.0",
    )


# --- the format ---------------------------------------------------------------------------------------------------


def test_a_log_reads_back_as_written_and_leaves_no_temporary(tmp_path: Path) -> None:
    log = make_log()
    log.write(tmp_path / "log.npz")
    back = read_log(tmp_path / "log.npz")
    for name, value in vars(log).items():
        np.testing.assert_array_equal(getattr(back, name), value, err_msg=name)
    assert [p.name for p in tmp_path.iterdir()] == ["log.npz"]
    with np.load(tmp_path / "log.npz", allow_pickle=False) as data:  # plain typed arrays, nothing pickled
        assert str(data["format"]) == FORMAT and int(data["version"]) == 2
        assert all(data[key].dtype != object for key in data.files)


def _arrays(**changes: object) -> dict[str, np.ndarray]:
    arrays = make_log().to_arrays()
    arrays.update({k: np.asarray(v) for k, v in changes.items()})
    return arrays


def _bad_logs(root: Path) -> dict[str, Path]:
    """Files that are not a whole log of a version fedaudit reads, by what is wrong with them."""
    good = make_log().to_bytes()
    files = {
        "text": b"round,cosine\n1,0.5\n",
        "truncated": good[: len(good) // 2],
        "empty": b"",
    }
    paths = {name: root / f"{name}.npz" for name in files}
    for name, data in files.items():
        paths[name].write_bytes(data)
    arrays = {
        "other-npz": {"x": np.zeros(3)},
        "wrong-version": _arrays(version=np.array(3, dtype=np.int64)),
        "no-version": {k: v for k, v in _arrays().items() if k != "version"},
        "missing-field": {k: v for k, v in _arrays().items() if k != "final_cosines"},
        "mismatched-rounds": _arrays(round_norms=np.ones(5)),
        "mismatched-canaries": _arrays(final_cosines=np.zeros(199)),
        "cosine-matrix-shape": _arrays(round_cosines=np.zeros((4, 201))),
        "not-cosines": _arrays(final_cosines=np.full(200, 3.0)),
        "nan-cosines": _arrays(final_cosines=np.full(200, np.nan)),
        "bits-not-0-1": _arrays(included=np.full(200, 2, dtype=np.int8)),
        "text-as-number": _arrays(delta=np.array("tiny")),
        "bad-delta": _arrays(delta=np.array(1.5)),
        "negative-sigma": _arrays(noise_multiplier=np.array(-1.0)),
        "nothing-released": _arrays(released=np.zeros(4, dtype=np.int8)),
        "population-too-small": _arrays(population=np.full(4, 10)),
        "float-bits": _arrays(included=np.full(200, 0.5)),
    }
    for name, content in arrays.items():
        paths[name] = root / f"{name}.npz"
        np.savez(paths[name], **content)
    evil = np.empty(2, dtype=object)
    evil[:] = [{"a": 1}, {"b": 2}]
    paths["pickled"] = root / "pickled.npz"
    np.savez(paths["pickled"], **{**_arrays(), "flower_report": evil})
    paths["folder"] = root / "folder"
    paths["folder"].mkdir()
    paths["nowhere"] = root / "nowhere.npz"
    return paths


def test_what_is_not_a_whole_log_is_one_sentence(tmp_path: Path) -> None:
    for name, path in _bad_logs(tmp_path).items():
        with pytest.raises(CanaryLogError) as caught:
            read_log(path)
        message = str(caught.value)
        assert message.endswith(".") and "\n" not in message and str(path) in message, (name, message)
    assert "pickled" in str(pytest.raises(CanaryLogError, read_log, tmp_path / "pickled.npz").value)
    assert "version 3" in str(pytest.raises(CanaryLogError, read_log, tmp_path / "wrong-version.npz").value)


def test_canaries_on_one_side_only_cannot_be_audited() -> None:
    log = make_log()
    one_side = CanaryLog(**{**vars(log), "included": np.ones(log.canaries, dtype=np.int8)})
    with pytest.raises(AttackError, match="at least two included and two excluded"):
        audit(one_side, source="x")


# --- scores and estimators ----------------------------------------------------------------------------------------


def _llr_by_hand(log: CanaryLog, i: int) -> float:
    """The all-iterates score of canary ``i``, one released round at a time in plain Python (the module's formula)."""
    total = 0.0
    for t in range(log.rounds):
        if not log.released[t]:
            continue
        row = sorted(float(c) for c in log.round_cosines[t])
        centre = statistics.median(row)
        spread = 1.4826 * statistics.median(abs(c - centre) for c in row)
        z = (float(log.round_cosines[t, i]) - centre) / spread
        q = log.sampled[t] / log.population[t] if math.isnan(log.sample_rate[t]) else float(log.sample_rate[t])
        mu = 1 / log.noise_multiplier
        if log.mechanism.startswith("local"):
            mu /= math.sqrt(log.sampled[t])
        total += math.log(1 - q + q * math.exp(mu * z - mu * mu / 2))
    return total


@pytest.mark.parametrize("mechanism", ["central DP, server-side clipping", "local DP (LocalDpMod)"])
def test_all_iterates_is_the_likelihood_ratio_over_released_rounds_and_final_model_the_final_cosine(mechanism) -> None:
    log = make_log(rounds=3, shift=2.0, mechanism=mechanism)
    cosines = log.round_cosines.copy()
    cosines[1] = 0.9  # a round that released nothing: its cosines must not count
    log = CanaryLog(**{**vars(log), "round_cosines": cosines, "released": np.array([1, 0, 1], dtype=np.int8)})
    scores = view_scores(log)
    for i in range(log.canaries):
        assert scores["all-iterates"][i] == pytest.approx(_llr_by_hand(log, i), rel=1e-9, abs=1e-12)
        assert scores["final-model"][i] == log.final_cosines[i]


def test_all_iterates_adds_up_the_rounds_where_every_client_is_sampled_and_takes_the_largest_cosine_without_noise():
    """q = 1: the ratio is mu sum_t z_t - T mu^2 / 2, so it ranks canaries by their summed standardised cosines;
    sigma = 0: the largest cosine."""
    log = make_log(rounds=4, shift=1.0, sampled=200, population=200, sigma=0.5)
    cosines = log.round_cosines
    z = (cosines - np.median(cosines, axis=1, keepdims=True)) / (
        1.4826 * np.median(np.abs(cosines - np.median(cosines, axis=1, keepdims=True)), axis=1, keepdims=True)
    )
    np.testing.assert_allclose(view_scores(log)["all-iterates"], 2.0 * z.sum(0) - 4 * 2.0**2 / 2, rtol=1e-9)
    silent = CanaryLog(**{**vars(log), "noise_multiplier": 0.0})
    np.testing.assert_array_equal(view_scores(silent)["all-iterates"], cosines.max(axis=0))


def test_with_clients_sampled_the_likelihood_ratio_separates_the_canaries_better_than_the_largest_cosine() -> None:
    """q = 0.1 over 20 rounds, an included canary present in each round with probability q and then shifted by
    mu = 1 / sigma noise deviations: the ratio's AUC is above the largest cosine's (whose one round drowns in the
    maxima of the others) and its bound at least as high."""
    rng = np.random.default_rng(11)
    log = make_log(canaries=4000, rounds=20, sampled=20, population=200, sigma=0.5, seed=11)
    present = (rng.random(log.round_cosines.shape) < 0.1) & log.included.astype(bool)[None, :]
    cosines = rng.normal(0.0, 0.02, log.round_cosines.shape) + present * 2.0 * 0.02
    log = CanaryLog(**{**vars(log), "round_cosines": cosines})
    ratio = audit(log, source="x", resamples=100).metrics["views"]["all-iterates"]
    largest = CanaryLog(**{**vars(log), "noise_multiplier": 0.0})  # sigma 0: the largest cosine
    baseline = audit(largest, source="x", resamples=100).metrics["views"]["all-iterates"]
    assert ratio["auc"] > baseline["auc"] + 0.01, (ratio["auc"], baseline["auc"])
    assert ratio["epsilon_lower_bound"] >= baseline["epsilon_lower_bound"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_clients_sampled_the_bound_grows_with_the_rounds_that_sample_each_canary(seed: int) -> None:
    """Poisson sampling at q = 0.1, sigma calibrated to epsilon 8 over the run's rounds, 1,000 canaries whose
    cosines are the mechanism's own (N(0, 1) in units of the noise, plus 1 / sigma in a round that samples the
    canary): in 10 rounds a third of the included canaries are never sampled, and the all-iterates bound stays low;
    in 100 rounds the ratio adds up about ten sampled rounds per canary, and the bound is above 0.3 of the
    accountant's epsilon (never above it)."""

    def ratio(rounds: int) -> float:
        sigma = calibrate_noise_multiplier(
            target_epsilon=8.0, sample_rate=0.1, queries_per_round=1, rounds=rounds, delta=DELTA
        )
        rng = np.random.default_rng(seed)
        log = make_log(canaries=1000, rounds=rounds, sampled=100, population=1000, sigma=sigma, seed=seed)
        present = (rng.random(log.round_cosines.shape) < 0.1) & log.included.astype(bool)[None, :]
        cosines = rng.normal(0.0, 0.02, log.round_cosines.shape) + present * 0.02 / sigma
        log = CanaryLog(**{**vars(log), "round_cosines": cosines, "sample_rate": np.full(rounds, 0.1)})
        metrics = audit(log, source="x", resamples=20).metrics
        assert metrics["accountant_epsilon"] == pytest.approx(8.0, rel=1e-3)
        return metrics["views"]["all-iterates"]["epsilon_lower_bound"] / metrics["accountant_epsilon"]

    few, many = ratio(10), ratio(100)
    assert 0.3 < many <= 1.0 and few < many, (few, many)


def test_gaussian_scores_give_the_closed_form_epsilon_and_a_bound_below_it() -> None:
    """Scores of mu-GDP exactly (unit Gaussians mu apart; one round, so that both views see one such draw): the
    estimate's interval holds epsilon(mu) and its mu is close to mu; each rigorous bound stays below epsilon(mu)
    and, with 4000 canaries, within 40% of it."""
    mu = 1.5
    truth = gdp_epsilon(mu, DELTA)
    log = make_log(canaries=4000, rounds=1, shift=mu, seed=3, sampled=200, population=200)  # present every round
    metrics = audit(log, source="x", resamples=400).metrics
    for name, view in metrics["views"].items():
        estimate = view["estimate"]
        assert abs(estimate["mu"] - mu) < 0.15, name
        assert estimate["ci95"][0] <= truth <= estimate["ci95"][1], name
        assert 0.6 * truth <= view["epsilon_lower_bound"] <= truth, name
        for bound in view["estimators"].values():
            assert bound["confidence"] == LEVEL and bound["epsilon"] <= truth


def test_the_audit_is_not_fooled_by_scores_independent_of_inclusion() -> None:
    """Null: cosines independent of the inclusion bits, 100 seeds: the largest of the four bounds (together a 95%
    statement) is positive in at most 5% of them."""
    positive = sum(
        audit(make_log(seed=seed, canaries=300), source="x", resamples=20).metrics["epsilon_lower_bound"] > 0
        for seed in range(100)
    )
    assert positive <= 5


# --- the accountant -----------------------------------------------------------------------------------------------


def test_full_participation_is_the_gaussian_mechanism_composed_in_closed_form() -> None:
    """Every client in every round: T releases of the Gaussian mechanism with noise multiplier sigma are
    sqrt(T)/sigma-GDP exactly; the PRV accountant must give that epsilon, RDP at least it."""
    log = make_log(rounds=5, sigma=1.5, sampled=200, population=200)
    exact = gdp_epsilon(math.sqrt(5) / 1.5, DELTA)
    assert accountant_epsilon(log, accountant="prv")["epsilon"] == pytest.approx(exact, abs=0.05)
    rdp = accountant_epsilon(log)
    assert exact <= rdp["epsilon"] <= exact * 1.15
    assert rdp["epsilon"] == pytest.approx(rdp["epsilon_without_sampling"])


def test_client_sampling_is_accounted_as_google_dp_accounting_does() -> None:
    dp_accounting = pytest.importorskip("dp_accounting")
    log = make_log(rounds=6, sigma=0.9, sampled=26, population=260)
    ours = accountant_epsilon(log)

    def google(rate: float) -> float:
        accountant = dp_accounting.rdp.RdpAccountant()
        event = dp_accounting.GaussianDpEvent(0.9)
        accountant.compose(dp_accounting.PoissonSampledDpEvent(rate, event) if rate < 1 else event, 6)
        return accountant.get_epsilon(DELTA)

    assert ours["sample_rates"] == [0.1] * 6
    assert ours["epsilon"] == pytest.approx(google(0.1), rel=0.03)
    assert ours["epsilon_without_sampling"] == pytest.approx(google(1.0), rel=0.03)
    local = accountant_epsilon(make_log(rounds=6, sigma=0.9, mechanism="local DP (LocalDpMod)"))
    assert local["sample_rates"] == [1.0] * 6 and local["epsilon"] == pytest.approx(google(1.0), rel=0.03)


# --- the results folder -------------------------------------------------------------------------------------------


def test_the_results_recompute_from_their_own_files(tmp_path: Path) -> None:
    """An auditor with scores.csv alone recomputes each view's two bounds: the judging canaries' scores at the
    recorded threshold give the recorded epsilon."""
    make_log(canaries=600, shift=1.0, seed=5).write(tmp_path / "log.npz")
    out = write_results(audit_log(tmp_path / "log.npz", resamples=50), tmp_path / "log-audit")
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "roc.csv", "scores.csv"]
    metrics = json.loads((out / "metrics.json").read_text())
    scores, curves = pd.read_csv(out / "scores.csv"), pd.read_csv(out / "roc.csv")
    assert len(scores) == 600 and set(curves["view"]) == {"all-iterates", "final-model"}
    for name, view in metrics["views"].items():
        judge = scores[scores[f"bound_role_{name}"] == "judge"]
        inside, outside = judge.loc[judge.included == 1, name].to_numpy(), judge.loc[judge.included == 0, name]
        for estimator, method in (("one-run", epsilon_one_run), ("gdp", epsilon_from_gdp)):
            recorded = view["estimators"][estimator]
            assert recorded["epsilon"] > 0 and (recorded["canaries_in"], recorded["canaries_out"]) == (
                len(inside),
                len(outside),
            )
            again = method(inside, outside.to_numpy(), delta=DELTA, confidence=LEVEL, threshold=recorded["threshold"])
            assert again.epsilon == pytest.approx(recorded["epsilon"], rel=1e-9)
    assert metrics["epsilon_lower_bound"] == max(v["epsilon_lower_bound"] for v in metrics["views"].values())
    assert metrics["epsilon_lower_bound_exceeds_accountant"] == (
        metrics["epsilon_lower_bound"] > metrics["accountant_epsilon"]
    )


def test_a_version_1_log_reads_with_exact_samples_and_a_poisson_log_is_accounted_at_its_rate(tmp_path: Path) -> None:
    """Version 1 (a Flower app's, before client-level runs) has no sample_rate: read as exactly n of N each round.
    A log whose rounds are Poisson samples at rate q (a client-level run's) is charged at q, whatever each round's
    count, and may have rounds that sampled no client."""
    import io

    log = make_log(rounds=3)
    arrays = {k: v for k, v in log.to_arrays().items() if k != "sample_rate"}
    arrays["version"] = np.array(1, dtype=np.int64)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    old = tmp_path / "old.npz"
    old.write_bytes(buffer.getvalue())
    assert np.isnan(read_log(old).sample_rate).all()
    poisson = CanaryLog(
        **{**vars(log), "sample_rate": np.full(3, 0.1), "sampled": np.array([0, 7, 3]), "population": np.full(3, 60)}
    )
    path = tmp_path / "poisson.npz"
    poisson.write(path)
    expected = compute_epsilon([SGMEvent(noise_multiplier=log.noise_multiplier, sample_rate=0.1, steps=3)], delta=DELTA)
    assert accountant_epsilon(read_log(path))["epsilon"] == pytest.approx(expected, rel=1e-12)
