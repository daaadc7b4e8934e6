"""``fedaudit verify`` of client-level DP runs: planted faults in the server's mechanism or its ledger are caught,
each by the check it breaks, and correct runs are never flagged (20 seeds). Runs draw from --noise-seed, so that each
outcome is the same on every machine (a faulty run's sample is not q K in every round, say)."""

from __future__ import annotations

import pytest
from helpers import FAST_ARGS, invoke, verified_client_level

import fedaudit.algorithms.fedavg as fedavg
import fedaudit.training as training

CLIENT_LEVEL = (
    *("--dp", "--dp-level", "client", "--max-update-norm", "0.2", "--noise-multiplier", "1"),
    *("--num-clients", "8", "--partition", "iid", "--client-fraction", "0.5", "--save-transmitted"),
)


def _verified(tmp_path, name: str, *extra: str):
    return verified_client_level(tmp_path / name, *CLIENT_LEVEL, *extra)


def test_correct_runs_are_never_flagged(tmp_path) -> None:
    for seed in range(20):
        verification = _verified(
            tmp_path, f"run-{seed}", "--rounds", "2", "--seed", str(seed), "--noise-seed", str(seed)
        )
        assert verification.passed, (seed, [c.sentence for c in verification.checks if not c.passed])


def _release(**changed):
    """The server's release with some of its arguments replaced (a planted fault)."""
    honest = fedavg.client_level_mean

    def faulty(updates, like, **kw):
        kw.update({k: (v(updates, kw) if callable(v) else v) for k, v in changed.items()})
        return honest(updates, like, **kw)

    return faulty


FAULTS = {
    "noise-removed": ("noise", _release(noise_multiplier=1e-9)),
    "noise-halved": ("noise", _release(noise_multiplier=lambda _, kw: kw["noise_multiplier"] / 2)),
    "clipping-off": ("clipping", _release(max_update_norm=1e9)),
    "realised-denominator": ("noise", _release(expected_clients=lambda updates, _: max(len(updates), 1))),
}


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_a_faulty_release_is_caught(tmp_path, monkeypatch, fault: str) -> None:
    check, release = FAULTS[fault]
    monkeypatch.setattr(fedavg, "client_level_mean", release)
    verification = _verified(tmp_path, "run", "--rounds", "3", "--noise-seed", "3")  # a sample not of q K each round
    assert not verification.check(check).passed, verification.check(check).sentence


def test_a_server_sampling_more_often_than_it_charges_is_caught(tmp_path, monkeypatch) -> None:
    honest = training.poisson_sample
    monkeypatch.setattr(
        training, "poisson_sample", lambda n, rate, generator: honest(n, min(1.0, 1.8 * rate), generator=generator)
    )
    verification = _verified(tmp_path, "run", "--rounds", "4", "--noise-seed", "3")
    assert not verification.check("sampling").passed, verification.check("sampling").sentence


def test_a_ledger_charging_half_the_sampling_rate_is_caught(tmp_path, monkeypatch) -> None:
    honest = training.round_events

    def cheaper(*, noise_multiplier, sample_rate, queries_per_round):
        return honest(
            noise_multiplier=noise_multiplier, sample_rate=sample_rate / 2, queries_per_round=queries_per_round
        )

    monkeypatch.setattr(training, "round_events", cheaper)
    verification = _verified(tmp_path, "run", "--rounds", "3", "--noise-seed", "3")
    assert not verification.check("ledger").passed and "undercharges" in verification.check("ledger").sentence


def test_verify_says_what_a_client_level_run_lacks(tmp_path) -> None:
    run = tmp_path / "run"
    args = [a for a in CLIENT_LEVEL if a != "--save-transmitted"]
    assert invoke("train", *FAST_ARGS, *args, "--rounds", "1", "--out", run).exit_code == 0
    result = invoke("verify", run)
    assert result.exit_code == 0 and "without --save-transmitted" in result.output


ADAPTIVE = ("--clipping", "adaptive", "--count-noise", "1")


def test_correct_adaptive_runs_are_flagged_no_more_often_than_the_level_allows(tmp_path) -> None:
    """20 correct runs: each is flagged with probability at most 0.001 (the checks' family-wise level), so two flags
    would be a one-in-5,000 event. One is tolerated: seed 9's server drew a count noise of -4.35 sigma_b in its first
    round (regenerated from its noise seed: a one-in-70,000 draw), which the quantile check rightly finds improbable
    (p 1.3e-5 over three rounds)."""
    flagged = []
    for seed in range(20):
        name, extra = f"run-{seed}", ("--rounds", "3", "--seed", str(seed), "--noise-seed", str(seed))
        verification = _verified(tmp_path, name, *ADAPTIVE, *extra)
        assert [c.name for c in verification.checks] == ["noise", "clipping", "quantile", "sampling", "ledger"]
        flagged += [(seed, c.name, c.p_value) for c in verification.checks if not c.passed]
    assert len(flagged) <= 1, flagged


def test_adaptive_clipping_whose_count_is_uncharged_or_unnoised_is_caught(tmp_path, monkeypatch) -> None:
    """Uncharged: the updates get the whole noise multiplier, as if the count cost nothing, and the count its own
    noise besides (the noise check sees too little noise); unnoised: the count released exact (the quantile check)."""
    with monkeypatch.context() as patch:
        patch.setattr(fedavg, "update_noise_multiplier", lambda sigma, count_noise: sigma)
        uncharged = _verified(tmp_path, "uncharged", *ADAPTIVE, "--rounds", "4", "--noise-seed", "3")
    assert not uncharged.check("noise").passed, uncharged.check("noise").sentence
    with monkeypatch.context() as patch:
        patch.setattr(fedavg, "add_gaussian", lambda total, std, source: total)
        exact = _verified(tmp_path, "exact", *ADAPTIVE, "--rounds", "4", "--noise-seed", "3")
    assert not exact.check("quantile").passed, exact.check("quantile").sentence
