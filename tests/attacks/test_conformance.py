"""Conformance of a canary run's DP queries: correct runs pass every check, a fault planted in the real training code
fails the check meant to see it, the ledger recomputation agrees with closed forms, and bad input is one sentence."""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FAST_ARGS, fixed_sequence_secrets, invoke, norms_without
from scipy.optimize import brentq
from scipy.stats import norm

import fedaudit.algorithms.base as base
import fedaudit.algorithms.fedavg as fedavg
import fedaudit.privacy.primitive as primitive
import fedaudit.training as training
from fedaudit.attacks import AttackError
from fedaudit.attacks.conformance.checks import CHECKS, PLD_INTERVAL, Verification, recorded_spend, verify
from fedaudit.privacy.accounting import rdp_epsilon
from fedaudit.rundir import RunDirectory

CANARY_RUN = (*FAST_ARGS, *"--dp --canaries 200 --noise-multiplier 1".split())


def train(out: Path, *extra: str) -> RunDirectory:
    result = invoke("train", *CANARY_RUN, *extra, "--out", out)
    assert result.exit_code == 0, result.output
    return RunDirectory(out)


def failed(verification: Verification) -> set[str]:
    return {check.name for check in verification.checks if not check.passed}


@pytest.fixture(scope="module")
def correct(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunDirectory, Verification, float]:
    run = train(tmp_path_factory.mktemp("conformance") / "run", "--rounds", "3")
    began = time.perf_counter()
    verification = verify(run)
    return run, verification, time.perf_counter() - began


def test_a_correct_run_passes_every_check(correct):
    run, verification, seconds = correct
    assert [check.name for check in verification.checks] == list(CHECKS)
    assert verification.passed, [check.sentence for check in verification.checks if not check.passed]
    assert verification.per_check_level == pytest.approx(0.001 / len(CHECKS))
    for check in verification.checks:
        assert check.p_value is not None and 0 <= check.p_value <= 1
        assert check.sentence.endswith(".") and "\n" not in check.sentence
    noise, clipping = verification.check("noise"), verification.check("clipping")
    assert noise.n >= 2 and noise.details["pairs"] == noise.n * (noise.n - 1) // 2
    assert clipping.details["largest_per_example_norm"] > 1  # C = 1: clipping did something to test
    assert verification.check("sampling").details["participation"] == [3] * 5
    assert json.loads(json.dumps(verification.to_dict()))["passed"] is True
    assert seconds < 30


def test_correct_runs_with_other_seeds_pass(tmp_path, monkeypatch):
    """The null side: at level 0.001 no correct run should fail. The run ids and clients' secrets come from a fixed
    sequence, so these are the same runs on every machine (with fresh ones a correct run fails at the checks' level,
    1 in 1,000: it happened twice, a tensor's noise variance 0.938 of the charged over 10,240 coordinates, and a
    step's noise correlated 0.149 with a public stream)."""
    fixed_sequence_secrets(monkeypatch, "null")
    for seed in range(1, 5):
        verification = verify(train(tmp_path / f"seed{seed}", "--rounds", "3", "--seed", str(seed)))
        assert verification.passed, (seed, [check.sentence for check in verification.checks if not check.passed])


def _smaller_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    real = primitive.noisy_sum

    def smaller(summed, *, noise_multiplier, max_grad_norm, generator):
        return real(summed, noise_multiplier=noise_multiplier / 1.5, max_grad_norm=max_grad_norm, generator=generator)

    monkeypatch.setattr(primitive, "noisy_sum", smaller)


def _noise_not_added(monkeypatch: pytest.MonkeyPatch) -> None:
    real = primitive.noisy_sum

    def drawn_only(summed, **kwargs):
        real(summed, **kwargs)
        return dict(summed)

    monkeypatch.setattr(primitive, "noisy_sum", drawn_only)


def _noise_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first noise draw of the run is added again at every later query (a draw kept where it should be made)."""
    real = primitive.noisy_sum
    first: dict[str, torch.Tensor] = {}

    def reused(summed, *, generator, **kwargs):
        released = real(summed, generator=generator, **kwargs)
        for name, s in summed.items():
            first.setdefault(name, released[name] - s)
        return {name: s + first[name] for name, s in summed.items()}

    monkeypatch.setattr(primitive, "noisy_sum", reused)


def _no_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    real = primitive.clipped_sum
    monkeypatch.setattr(primitive, "clipped_sum", lambda model, x, y, _, **kw: real(model, x, y, math.inf, **kw))


def _fixed_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    def fixed(num_records, sample_rate, *, generator):
        order = torch.randperm(num_records, generator=generator, device=generator.device)
        return order[: round(num_records * sample_rate)].sort().values

    monkeypatch.setattr(base, "poisson_sample", fixed)


def _clipping_after_noising(monkeypatch: pytest.MonkeyPatch) -> None:
    """The noisy sum is clipped to C as a whole after the noise is added (the order of two lines swapped)."""
    real = primitive.noisy_sum

    def clipped_late(summed, *, max_grad_norm, **kwargs):
        released = real(summed, max_grad_norm=max_grad_norm, **kwargs)
        norm = torch.sqrt(sum(t.pow(2).sum() for t in released.values()))
        factor = min(1.0, max_grad_norm / float(norm))
        return {name: t * factor for name, t in released.items()}

    monkeypatch.setattr(primitive, "noisy_sum", clipped_late)


def _batch_clipping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch's summed gradient is clipped to C instead of each example's gradient."""
    real = primitive.clipped_sum

    def whole_batch(model, x, y, max_grad_norm, **kwargs):
        summed, norms = real(model, x, y, math.inf, **kwargs)
        norm = float(torch.sqrt(sum(t.pow(2).sum() for t in summed.values())))
        factor = min(1.0, max_grad_norm / norm) if norm > 0 else 1.0
        return {name: t * factor for name, t in summed.items()}, norms

    monkeypatch.setattr(primitive, "clipped_sum", whole_batch)


def _biases_not_noised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Noise is added to the weights only: a loop over parameters that skips the biases."""
    real = primitive.noisy_sum

    def weights_only(summed, **kwargs):
        released = real(summed, **kwargs)
        return {name: summed[name] if name.endswith("bias") else t for name, t in released.items()}

    monkeypatch.setattr(primitive, "noisy_sum", weights_only)


def _clipping_at_twice_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Examples are clipped to 2 C while the noise and the ledger assume C (two settings read from two places)."""
    real = primitive.clipped_sum
    monkeypatch.setattr(primitive, "clipped_sum", lambda model, x, y, c, **kw: real(model, x, y, 2 * c, **kw))


def _norm_without_the_first_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-example norm summed over every tensor but the first (the largest): the released part of an example's
    gradient is no longer bounded by C. The single direction of what clipping takes away missed it (p > 0.5)."""
    norms_without(monkeypatch, lambda names: names[:1])


def _biases_unclipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's bias summed without the examples' clipping factors (the weights clipped): the whole model's
    direction of what clipping takes away dilutes it (p > 0.5); each tensor's own direction does not."""
    real = primitive.layer_weighted_sums

    def biases_whole(layer, factors):
        clipped, whole = real(layer, factors), real(layer, torch.ones_like(factors))
        return {name: whole[name] if name.endswith("bias") else part for name, part in clipped.items()}

    monkeypatch.setattr(primitive, "layer_weighted_sums", biases_whole)


def _sampler_rate_doubled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler draws at twice the rate it is given (a rate computed from half the records)."""
    real = base.poisson_sample
    monkeypatch.setattr(
        base, "poisson_sample", lambda n, rate, *, generator: real(n, min(1.0, 2 * rate), generator=generator)
    )


def _ledger_sigma_inflated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ledger charges a noise multiplier 1.5 times the one the queries used."""
    real = training.round_events
    monkeypatch.setattr(
        training, "round_events", lambda **kw: real(**{**kw, "noise_multiplier": kw["noise_multiplier"] * 1.5})
    )


def _ledger_rate_halved(monkeypatch: pytest.MonkeyPatch) -> None:
    real = training.round_events
    monkeypatch.setattr(training, "round_events", lambda **kw: real(**{**kw, "sample_rate": kw["sample_rate"] / 2}))


def _ledger_one_step_short(monkeypatch: pytest.MonkeyPatch) -> None:
    real = training.round_events
    monkeypatch.setattr(
        training, "round_events", lambda **kw: real(**{**kw, "queries_per_round": kw["queries_per_round"] - 1})
    )


@pytest.mark.parametrize(
    ("fault", "check", "says"),
    [
        pytest.param(_smaller_noise, "noise", "variance 0.4", id="noise-std-too-small-by-1.5"),
        pytest.param(_noise_not_added, "noise", "e-1", id="noise-drawn-but-not-added"),
        pytest.param(_noise_reused, "noise", "a noise draw was reused", id="noise-reused-across-steps"),
        pytest.param(_no_clipping, "clipping", "not clipped to C", id="clipping-switched-off"),
        pytest.param(_fixed_batches, "sampling", "not Poisson samples", id="fixed-batch-size"),
        pytest.param(_ledger_rate_halved, "sampling", "but the ledger charges", id="ledger-charges-a-lower-rate"),
        pytest.param(_ledger_one_step_short, "ledger", "made 8 DP queries but the ledger charged it 7", id="steps"),
        pytest.param(_clipping_after_noising, "noise", "variance 0.", id="clipping-after-noising"),
        pytest.param(_batch_clipping, "noise", "not (sigma C)^2", id="batch-clipped-not-each-example"),
        pytest.param(_biases_not_noised, "noise", "bias of", id="biases-not-noised"),
        pytest.param(_clipping_at_twice_c, "clipping", "not clipped to C", id="clipped-to-2C"),
        pytest.param(_norm_without_the_first_tensor, "clipping", "not clipped to C", id="norm-without-a-tensor"),
        pytest.param(_biases_unclipped, "clipping", "bias is not clipped to C", id="biases-unclipped"),
        pytest.param(_sampler_rate_doubled, "sampling", "average", id="sampler-at-twice-the-rate"),
        pytest.param(_ledger_sigma_inflated, "ledger", "but the ledger charged 1.5", id="ledger-charges-more-noise"),
    ],
)
def test_a_planted_fault_fails_its_check(tmp_path, monkeypatch, fault: Callable, check: str, says: str):
    """Each fault is planted in the real training code, only while training."""
    fault(monkeypatch)
    run = train(tmp_path / "run", "--rounds", "3")
    monkeypatch.undo()
    verification = verify(run)
    assert not verification.passed
    found = verification.check(check)
    assert not found.passed and found.p_value is not None and found.p_value <= verification.per_check_level
    assert says in found.sentence, found.sentence
    assert verification.check("log").passed  # the log records faithfully what the faulty code did


def test_a_rate_the_ledger_undercharges_also_fails_the_ledger(tmp_path, monkeypatch):
    _ledger_rate_halved(monkeypatch)
    run = train(tmp_path / "run", "--rounds", "3")
    monkeypatch.undo()
    ledger = verify(run).check("ledger")
    assert not ledger.passed and "sampled at rate" in ledger.sentence
    assert all(not client["covered"] for client in ledger.details["clients"].values())


def test_noiseless_queries_are_recomputed_exactly_and_their_ledger_fails(tmp_path, monkeypatch):
    """sigma = 0 reaches the primitive (and the log) while the ledger charges sigma = 1: each released sum must be the
    clean clipped sum itself, and the ledger, which charged noise that was never added, must fail."""
    real = fedavg.dp_gradient
    monkeypatch.setattr(fedavg, "dp_gradient", lambda *a, **kw: real(*a, **{**kw, "noise_multiplier": 0.0}))
    run = train(tmp_path / "run", "--rounds", "3")
    monkeypatch.undo()
    verification = verify(run)
    noise = verification.check("noise")
    assert noise.passed and noise.details["zero_noise_queries"] == noise.n > 0
    assert verification.check("clipping").passed
    ledger = verification.check("ledger")
    assert not ledger.passed and "noise multiplier 0" in ledger.sentence
    assert all(client["rdp"] == math.inf for client in ledger.details["clients"].values())


def test_clipping_switched_off_without_noise_is_an_exact_failure(tmp_path, monkeypatch):
    real = fedavg.dp_gradient
    monkeypatch.setattr(fedavg, "dp_gradient", lambda *a, **kw: real(*a, **{**kw, "noise_multiplier": 0.0}))
    _no_clipping(monkeypatch)
    run = train(tmp_path / "run", "--rounds", "2")
    monkeypatch.undo()
    clipping = verify(run).check("clipping")
    assert not clipping.passed and clipping.p_value == 0 and "not clipped to C" in clipping.sentence


def test_participation_with_client_sampling(tmp_path):
    """3 of 5 clients a round over 6 rounds: sampling passes, and the ledger, which charges each client for the
    rounds it took part in with no discount for client sampling, covers every client's recorded queries exactly."""
    run = train(tmp_path / "run", "--rounds", "6", "--client-fraction", "0.6")
    verification = verify(run)
    assert failed(verification) == set(), {c.name: c.sentence for c in verification.checks if not c.passed}
    participation = verification.check("sampling").details["participation"]
    assert sum(participation) == 6 * 3
    clients = verification.check("ledger").details["clients"]
    assert all(client["covered"] for client in clients.values())
    assert {int(k): client["rounds"] for k, client in clients.items()} == {
        k: n for k, n in enumerate(participation) if n
    }


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_the_old_discount_for_client_sampling_is_caught(tmp_path, monkeypatch, accountant):
    """A ledger that discounts each round's first query to p q and charges clients for rounds they sat out (the
    accounting of FedLAP-DP's paper) under-charges a client chosen in every round: verify FAILs it, against the
    exact RDP for an RDP ledger and against dp-accounting's PLD lower bound for a PRV one."""
    import fedaudit.training as training
    from fedaudit.privacy.accounting import SGMEvent

    def discounted(setup, messages, round_index, selected):
        p = setup.client_fraction
        return {
            k: [
                SGMEvent(noise_multiplier=setup.config.privacy.noise_multiplier, sample_rate=p * q, steps=1),
                SGMEvent(
                    noise_multiplier=setup.config.privacy.noise_multiplier, sample_rate=q, steps=setup.queries[k] - 1
                ),
            ]
            for k, q in setup.sample_rates.items()
        }

    monkeypatch.setattr(training, "_round_privacy_events", discounted)
    run = train(tmp_path / "run", "--rounds", "6", "--client-fraction", "0.6", "--accountant", accountant)
    monkeypatch.undo()
    verification = verify(run)
    participation = verification.check("sampling").details["participation"]
    assert 6 in participation  # this seed chooses some client in every round
    ledger = verification.check("ledger")
    assert not ledger.passed and "spend" in ledger.sentence
    assert ("optimistic discretisation" in ledger.sentence) == (accountant == "prv"), ledger.sentence
    uncovered = {int(k) for k, client in ledger.details["clients"].items() if not client["covered"]}
    assert uncovered == {k for k, count in enumerate(participation) if count == 6}


def test_the_rdp_recomputation_matches_the_ledger_of_a_correct_run(correct):
    run, verification, _ = correct
    ledger = run.read_privacy()
    clients = verification.check("ledger").details["clients"]
    assert set(clients) == set(ledger["per_client"])
    for k, client in clients.items():
        says = ledger["per_client"][k]["epsilon"]
        assert client["ledger"] == says
        assert client["rdp"] == pytest.approx(says, rel=1e-6)  # exact RDP at a superset of the ledger's orders
    # dp-accounting's own accountants, for the client that spends most (seconds a client: not for every one)
    most = max(clients, key=lambda k: clients[k]["rdp"])
    assert {k for k, client in clients.items() if "pld" in client} == {most}
    client = clients[most]
    assert client["rdp_dp_accounting"] == pytest.approx(client["ledger"], rel=1e-3)  # conservative
    assert client["pld_lower"] <= client["pld"] < client["rdp"]


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon of a mu-GDP mechanism (the Gaussian mechanism, Balle and Wang 2018) at ``delta``."""

    def delta_at(epsilon: float) -> float:
        return norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2)

    return brentq(lambda e: delta_at(e) - delta, 0.0, 500.0)


@pytest.mark.parametrize(("sigma", "steps"), [(1.0, 10), (3.0, 50), (30.0, 200)])
def test_the_spend_of_unsampled_queries_is_the_gaussian_mechanism(sigma: float, steps: int):
    """q = 1: n queries at noise multiplier sigma are one Gaussian mechanism with mu = sqrt(n) / sigma (closed form),
    and their RDP is n alpha / (2 sigma^2) at every order."""
    delta = 1e-5
    spend = recorded_spend({(sigma, 1.0): steps}, delta)
    exact = _gaussian_epsilon(math.sqrt(steps) / sigma, delta)
    assert spend.pld_lower <= exact + 1e-9 <= spend.pld + 2e-9
    assert spend.pld - exact < 1e-3 * max(exact, 1.0)  # connect-the-dots: pessimistic, and tight
    assert exact - spend.pld_lower <= steps * PLD_INTERVAL  # privacy buckets: each step rounds down by < h
    orders = np.array([1 + x / 10 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024], dtype=float)
    rdp = steps * orders / (2 * sigma**2)
    closed = np.min(rdp + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1))
    assert spend.rdp == pytest.approx(closed, rel=1e-9)
    assert spend.rdp_dp_accounting == pytest.approx(closed, rel=1e-9)
    assert spend.rdp >= exact


@pytest.mark.parametrize(("sigma", "rate", "steps"), [(1.0, 0.124, 100), (0.7, 0.3, 300), (2.0, 0.02, 1000)])
def test_the_rdp_spend_of_sampled_queries_is_opacus_exact_rdp(sigma: float, rate: float, steps: int):
    """Poisson-sampled queries against fedaudit's ledger arithmetic (Opacus' exact RDP, a subset of the orders):
    never above it, and equal where the optimum is at one of its orders. dp-accounting's own RDP can be above it:
    its series at fractional orders over-estimates."""
    ledger = rdp_epsilon(((sigma, rate, steps),), 1e-5)
    spend = recorded_spend({(sigma, rate): steps}, 1e-5)
    assert ledger * (1 - 1e-3) <= spend.rdp <= ledger * (1 + 1e-9)
    assert spend.rdp_dp_accounting >= spend.rdp * (1 - 1e-9)
    assert spend.pld_lower <= spend.pld <= spend.rdp


def test_runs_without_dp_or_without_the_query_log_are_one_sentence(plain_run, dp_run, correct, tmp_path):
    with pytest.raises(AttackError, match="without DP"):
        verify(RunDirectory(plain_run))
    with pytest.raises(AttackError, match="trained without the query log; train with --dp --canaries N"):
        verify(RunDirectory(dp_run))
    copy = tmp_path / "copy"
    shutil.copytree(correct[0].path, copy)
    (copy / "queries" / "round-0002.safetensors").unlink()
    with pytest.raises(AttackError, match=r"without the query log.*round 2"):
        verify(RunDirectory(copy))
    with pytest.raises(AttackError, match="level"):
        verify(correct[0], level=1.5)
    with pytest.raises(AttackError, match="not a directory"):
        verify(RunDirectory(tmp_path / "nothing"))


def test_input_canary_runs_pass_even_when_verified_under_no_grad(tmp_path):
    """Input canaries are rows of the kept batches (no gradient canary to add); the reference loop differentiates
    whatever the caller's grad mode."""
    run = train(tmp_path / "run", *"--rounds 2 --canary-kind input --canaries 100 --holdout-fraction 0.3".split())
    with torch.no_grad():
        verification = verify(run)
    assert verification.passed, [check.sentence for check in verification.checks if not check.passed]
    assert verification.check("noise").n > 0


def _edit_ledger(run: RunDirectory, tmp_path: Path, change: Callable[[dict], None]) -> RunDirectory:
    copy = tmp_path / "copy"
    shutil.copytree(run.path, copy)
    privacy = json.loads((copy / "privacy.json").read_text())
    change(privacy)
    (copy / "privacy.json").write_text(json.dumps(privacy))
    return RunDirectory(copy)


def test_a_ledger_epsilon_below_the_recorded_spend_fails(correct, tmp_path):
    """A ledger 1% below what its client's queries spend: caught by the exact RDP recomputation, not by PLD (RDP is
    looser than PLD by more than that)."""

    def lower(privacy: dict) -> None:
        privacy["per_client"]["2"]["epsilon"] *= 0.99

    ledger = verify(_edit_ledger(correct[0], tmp_path, lower)).check("ledger")
    assert not ledger.passed and ledger.p_value == 0
    assert ledger.sentence.startswith("Client 2's ledger says epsilon ")
    assert ledger.sentence.endswith("(RDP at dp-accounting's orders).")
    assert [k for k, client in ledger.details["clients"].items() if not client["covered"]] == ["2"]


def test_a_ledger_that_disagrees_with_itself_fails(correct, tmp_path):
    def inconsistent(privacy: dict) -> None:
        privacy["epsilon_per_round"][-1] *= 2
        privacy["history"]["rounds"].pop()

    ledger = verify(_edit_ledger(correct[0], tmp_path, inconsistent)).check("ledger")
    assert not ledger.passed
    failures = " ".join(ledger.details["failures"])
    assert "records 2 rounds and 3 epsilons" in failures and "is not the largest of its clients'" in failures
    assert "are not the composition of its history" in failures and "ledger charged it 0" in failures


def test_a_malformed_ledger_is_one_sentence(correct, tmp_path):
    with pytest.raises(AttackError, match="privacy.json is malformed"):
        verify(_edit_ledger(correct[0], tmp_path, lambda privacy: privacy.pop("history")))


def _tamper(run: RunDirectory, tmp_path: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> RunDirectory:
    """A copy of ``run`` whose round-1 log of its first client has been changed in place by ``change``."""
    copy = RunDirectory(tmp_path / "tampered")
    shutil.copytree(run.path, copy.path)
    logs = copy.queries.load(1)
    kept = next(k for k, log in logs.items() if "kept0/params" in log)
    change(logs[kept])
    copy.queries.save(1, logs)
    return copy


@pytest.mark.parametrize(
    ("change", "says"),
    [
        pytest.param(lambda log: log.update(rate=log["rate"][:-1]), "counts its queries differently", id="lengths"),
        pytest.param(lambda log: log["records"].__setitem__(0, math.nan), "non-finite", id="non-finite"),
        pytest.param(lambda log: log.pop("batch"), "has no 'batch' array", id="missing-array"),
        pytest.param(lambda log: log.update({"kept0/params": log["kept0/params"][:-3]}), "parameters", id="shape"),
        pytest.param(
            lambda log: log.update({"kept0/x": log["kept0/x"][1:], "kept0/y": log["kept0/y"][1:]}),
            "examples, but its step drew",
            id="batch-rows",
        ),
        pytest.param(lambda log: log.update({"kept0/step": torch.tensor([999])}), "step 999", id="step"),
        pytest.param(lambda log: log.pop("kept0/released"), "has no released", id="kept-part-missing"),
    ],
)
def test_a_tampered_log_fails_the_log_check(correct, tmp_path, change, says: str):
    verification = verify(_tamper(correct[0], tmp_path, change))
    log = verification.check("log")
    assert not log.passed and log.p_value == 0.0
    assert says in log.sentence, log.sentence
    assert len(verification.checks) == len(CHECKS)
