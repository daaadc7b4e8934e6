"""The sensitivity probe: its reference against a closed form, correct code never flagged, and faults planted in the
real training path (outside the probe's own cases: norms over part of the model, a divisor from the batch, clipping
of a batch mean, noise from the data, an algorithm that clips on its own) caught, by the command line too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_user_error, invoke, norms_without
from torch import nn

import fedaudit.algorithms.fedavg as fedavg
import fedaudit.privacy.primitive as primitive
from fedaudit.attacks import AttackError
from fedaudit.attacks.conformance.probe import clipped, probe_config, reference_gradient, sensitivity_check
from fedaudit.config import RunConfig


def config(algorithm: str = "fedavg", arch: str = "mlp", **privacy: float) -> RunConfig:
    return RunConfig.from_dict(
        {
            "federated": {"algorithm": algorithm, "rounds": 2, "batch_size": 16},
            "data": {"dataset": "digits", "num_clients": 2},
            "model": {"arch": arch, "width": 8, "depth": 1},
            "privacy": {"dp": True, "noise_multiplier": 1.0, "max_grad_norm": 1.0, **privacy},
        }
    )


def probed(algorithm: str = "fedavg", arch: str = "mlp", **privacy: float):
    return sensitivity_check(probe_config(config(algorithm, arch, **privacy)))


def test_the_reference_is_the_closed_form_of_a_linear_softmax():
    """For logits W x + b and cross-entropy, the gradient is (softmax - onehot) x^T and (softmax - onehot)."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    x, y = torch.randn(1, 5), torch.tensor([2])
    params = {name: p.detach() for name, p in model.named_parameters()}
    got = reference_gradient(model, params, F.cross_entropy, x, y)
    with torch.no_grad():
        p = torch.softmax(model(x).double(), dim=1)[0]
    residual = p - F.one_hot(y, 3)[0].double()
    torch.testing.assert_close(got["weight"], torch.outer(residual, x[0].double()))
    torch.testing.assert_close(got["bias"], residual)
    whole = torch.cat([torch.outer(residual, x[0].double()).flatten(), residual])
    assert float(clipped(got, 0.01).norm()) == pytest.approx(0.01)
    torch.testing.assert_close(clipped(got, 0.01), whole * (0.01 / float(whole.norm())))
    torch.testing.assert_close(clipped(got, 1e6), whole)


@pytest.mark.parametrize(
    ("algorithm", "arch"),
    [
        ("fedavg", "mlp"),
        ("fedprox", "mlp"),
        ("fedsgd", "mlp"),
        ("scaffold", "mlp"),
        ("fedlap", "convnet"),
        ("fedssyn", "mlp"),
    ],
)
def test_correct_queries_pass(algorithm, arch):
    check = probed(algorithm, arch)
    assert check.passed, check.sentence
    cases = {o["case"] for o in check.details["outcomes"]}
    assert {"a huge record", "a blank record", "a huge record alone", "a gradient record over the model"} <= cases
    assert any(case.startswith("a gradient record in layer") for case in cases)
    assert check.details["largest_norm_over_clip"] <= 1 + 1e-4
    assert check.details["largest_norm_over_clip"] > 0.99  # the huge records were clipped to C, not below


def test_correct_queries_pass_at_other_settings():
    """The null side at a larger and a smaller noise and a smaller clipping norm: the replayed noise cancels."""
    for privacy in ({"noise_multiplier": 5.0}, {"max_grad_norm": 0.01}, {"noise_multiplier": 0.3}):
        check = probed(**privacy)
        assert check.passed, (privacy, check.sentence)


@pytest.mark.parametrize("left_out", [lambda names: names[-1:], lambda names: names[:1]], ids=["last-bias", "first"])
def test_a_norm_over_part_of_the_model_is_caught(monkeypatch, left_out):
    norms_without(monkeypatch, left_out)
    check = probed("fedavg", "convnet")
    assert not check.passed
    assert "more than C" in check.sentence and check.statistic > 1.001


def test_a_norm_over_part_of_a_gradient_record_is_caught(monkeypatch):
    """The gradient canaries' path (no input) computes its norms elsewhere: a tensor left out there is caught by the
    gradient records concentrated in that tensor."""
    real = primitive.per_sample_norms

    def partial(grads):
        return real({name: g for name, g in list(grads.items())[1:]})

    monkeypatch.setattr(primitive, "per_sample_norms", partial)
    check = probed()
    assert not check.passed
    outcomes = check.details["outcomes"]
    first = next(
        o["case"] for o in outcomes if o["case"].startswith("a gradient record in ") and " layer " not in o["case"]
    )
    worst = max(outcomes, key=lambda o: o["norm_over_clip"])
    assert worst["case"] == first and worst["norm_over_clip"] == pytest.approx(10.0), worst  # left unclipped


def test_division_by_the_batch_s_own_size_is_caught(monkeypatch):
    """The call site turns the documented divisor (the expected batch size) into the batch's own size."""
    real = fedavg.dp_gradient

    def own_size(model, x, y, **kwargs):
        result = real(model, x, y, **kwargs)
        scale = kwargs["expected_batch_size"] / max(1, len(y))
        return primitive.DPGradient(
            {n: g * scale for n, g in result.grads.items()}, result.batch_size, result.per_sample_norms
        )

    monkeypatch.setattr(fedavg, "dp_gradient", own_size)
    assert not probed().passed


def test_clipping_the_batch_mean_is_caught(monkeypatch):
    """Microbatch clipping: the batch's mean gradient clipped to C, times the batch size."""
    real = primitive.clipped_sum

    def mean_clipped(model, x, y, max_grad_norm, **kwargs):
        summed, norms = real(model, x, y, 1e12, **kwargs)
        total = float(torch.cat([s.flatten() for s in summed.values()]).norm()) / max(1, len(y))
        factor = min(1.0, max_grad_norm / (total + 1e-12))
        return {name: s * factor for name, s in summed.items()}, norms

    monkeypatch.setattr(primitive, "clipped_sum", mean_clipped)
    check = probed()
    assert not check.passed and "more than C" in check.sentence


def test_noise_that_depends_on_the_data_is_caught(monkeypatch):
    """The noise scaled by the clipped sum's norm: the replayed noise no longer cancels."""
    real = primitive.noisy_sum

    def data_scaled(summed, *, noise_multiplier, max_grad_norm, generator):
        size = float(torch.cat([s.flatten() for s in summed.values()]).norm())
        return real(
            summed, noise_multiplier=noise_multiplier * (1 + size), max_grad_norm=max_grad_norm, generator=generator
        )

    monkeypatch.setattr(primitive, "noisy_sum", data_scaled)
    assert not probed().passed


def _noise_not_used(monkeypatch):
    """DP-FedAvg's step computes the noisy query and uses the clean clipped mean (the noise seen by a recorder only)."""
    real = fedavg.dp_gradient

    def clean(model, x, y, **kwargs):
        real(model, x, y, **kwargs)
        return real(model, x, y, **{**kwargs, "noise_multiplier": 0.0, "recorder": None})

    monkeypatch.setattr(fedavg, "dp_gradient", clean)


def _noisy_sum(change):
    def plant(monkeypatch):
        monkeypatch.setattr(primitive, "noisy_sum", change(primitive.noisy_sum))

    return plant


def _reused(real):
    first = {}

    def reused(summed, **kwargs):
        released = real(summed, **kwargs)
        for name, s in summed.items():
            first.setdefault(name, released[name] - s)
        return {name: s + first[name] for name, s in summed.items()}

    return reused


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(_noise_not_used, id="noise-not-used"),
        pytest.param(_noisy_sum(lambda real: lambda s, *, noise_multiplier, **kw: real(
            s, noise_multiplier=noise_multiplier / 1.5, **kw)), id="noise-too-small-by-1.5"),
        pytest.param(_noisy_sum(lambda real: lambda s, **kw: {
            n: s[n] if n.endswith("bias") else t for n, t in real(s, **kw).items()}), id="biases-not-noised"),
        pytest.param(_noisy_sum(_reused), id="one-draw-reused"),
    ],
)  # fmt: skip
def test_noise_that_is_not_the_charged_draw_from_the_given_source_is_caught(monkeypatch, plant):
    """The base batch answered with two seeds: the answers must differ by two draws of N(0, (sigma C)^2) in every
    tensor; none of these faults changes what a record adds."""
    plant(monkeypatch)
    check = probed()
    assert not check.passed and "does not add the noise" in check.sentence, check.sentence
    assert check.p_value <= 0.001


def test_scaling_every_example_to_c_is_not_the_documented_sum(monkeypatch):
    """Clipping without its cap at 1 on the gradient records' path (small gradients scaled up to C): within C, so
    no privacy is lost, but the query is not the clipped sum (the tiny gradient record shows it)."""

    def uncapped(grads, max_grad_norm):
        norms = primitive.per_sample_norms(grads)
        factors = max_grad_norm / (norms + 1e-6)
        return {name: torch.einsum("b,b...->...", factors, g) for name, g in grads.items()}, norms

    monkeypatch.setattr(primitive, "clip_and_sum", uncapped)
    check = probed()
    assert not check.passed
    assert "not the clipped sum" in check.sentence and "tiny" in check.sentence


def test_an_algorithm_that_clips_on_its_own_fails(monkeypatch):
    """A DP round that never calls the DP primitive cannot be probed, and says so as a failure."""

    def own_step(self, model, optimizer, global_params, data, ctx, generator, correction):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        return [], {"local_steps": 1.0}

    monkeypatch.setattr(fedavg.FedAvg, "_train_dp", own_step)
    from fedaudit.attacks.conformance.probe import _NoQuery

    with pytest.raises(_NoQuery, match="made no DP query through the DP primitive"):
        probe_config(config())


def test_a_run_without_record_level_dp_is_refused():
    with pytest.raises(AttackError, match="without --dp"):
        probe_config(RunConfig.from_dict({"data": {"dataset": "digits"}, "model": {"arch": "mlp"}}))


def test_an_overflowing_record_adds_nothing():
    """A record whose gradient is not finite is scaled to zero by the primitive (it would otherwise make the whole
    sum NaN): on both of its paths."""
    model = nn.Sequential(nn.Linear(4, 3))
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [float("inf"), 0.0, 0.0, 0.0]])
    y = torch.tensor([0, 1])
    with_inf, norms = primitive.clipped_sum(model, x, y, 1.0)
    alone, _ = primitive.clipped_sum(model, x[:1], y[:1], 1.0)
    assert not bool(torch.isfinite(norms).all())
    for name in alone:
        torch.testing.assert_close(with_inf[name], alone[name])
    grads = {"w": torch.tensor([[1.0, 0.0], [float("nan"), 1.0]])}
    summed, _ = primitive.clip_and_sum(grads, 1.0)
    torch.testing.assert_close(summed["w"], torch.tensor([1.0, 0.0]), atol=1e-5, rtol=0)


def test_verify_probe_on_a_run_without_canaries(dp_run: Path, tmp_path: Path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(dp_run, run)
    result = invoke("verify", str(run), "--probe")
    assert result.exit_code == 0, result.output
    assert "PASS sensitivity" in result.output and "no query log" in result.output
    written = json.loads((run / "verification.json").read_text())
    check = written["checks"][0]
    assert check["name"] == "sensitivity" and check["passed"]
    points = {o["point"] for o in check["details"]["outcomes"]}
    assert points == {"initial", "final"}


def test_verify_probe_of_a_run_without_dp_is_one_sentence(plain_run: Path):
    assert_user_error(invoke("verify", str(plain_run), "--probe"), mentions="without --dp")


def test_verify_probe_joins_the_conformance_checks_of_a_canary_run(tmp_path: Path):
    from helpers import FAST_ARGS

    run = tmp_path / "canary"
    trained = invoke("train", *FAST_ARGS, "--dp", "--canaries", "50", "--rounds", "1", "--out", str(run))
    assert trained.exit_code == 0, trained.output
    result = invoke("verify", str(run), "--probe")
    assert result.exit_code == 0, result.output
    names = [check["name"] for check in json.loads((run / "verification.json").read_text())["checks"]]
    assert names[-1] == "sensitivity" and "ledger" in names and "clipping" in names
