"""Per-record signals against slow per-example loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedaudit.attacks.membership.signals import PER_LAYER_PREFIX, compute_signals, oriented
from fedaudit.models import ModelSpec, build_model

# ---------------------------------------------------------------------------- signals

SPECS = {
    "mlp": ModelSpec("mlp", (1, 8, 8), 10, width=16, depth=2),
    "convnet": ModelSpec("convnet", (1, 8, 8), 10, width=6, depth=2),
}


def model_and_records(name: str, n: int = 11) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    spec = SPECS[name]
    return build_model(spec), torch.randn(n, *spec.input_shape), torch.randint(0, spec.num_classes, (n,))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_output_signals_match_a_plain_loop(name: str) -> None:
    model, x, y = model_and_records(name)
    got = compute_signals(model, x, y, ["loss", "confidence", "logit-confidence"], batch_size=4).values
    for i in range(len(y)):
        with torch.no_grad():
            logits = model(x[i : i + 1]).double()
        loss = F.cross_entropy(logits, y[i : i + 1])
        p = torch.softmax(logits, dim=1)[0]
        assert got["loss"][i] == pytest.approx(float(loss), rel=1e-6)
        assert got["confidence"][i] == pytest.approx(float(p[y[i]]), rel=1e-6)
        assert got["logit-confidence"][i] == pytest.approx(float(torch.log(p[y[i]]) - torch.log(1 - p[y[i]])), rel=1e-6)


def test_logit_confidence_stays_exact_when_the_model_is_certain() -> None:
    model = torch.nn.Identity()
    logits = torch.tensor([[60.0, 0.0, 0.0], [0.0, 5.0, 0.0]])  # 1 - p_y = 2e-26 rounds to 0 in float64
    got = compute_signals(model, logits, torch.tensor([0, 1]), ["logit-confidence", "loss"]).values
    assert got["logit-confidence"][0] == pytest.approx(60.0 - math.log(2.0))
    assert got["logit-confidence"][1] == pytest.approx(5.0 - math.log(2.0))
    assert np.all(np.isfinite(got["logit-confidence"]))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_gradient_norms_match_per_example_autograd(name: str) -> None:
    model, x, y = model_and_records(name)
    signals = compute_signals(model, x, y, ["grad-norm"], per_layer=True, batch_size=4)
    layers = {}
    for param_name, _ in model.named_parameters():
        layers.setdefault(param_name.rpartition(".")[0], []).append(param_name)
    assert set(signals.per_layer) == {PER_LAYER_PREFIX + layer for layer in layers}
    for i in range(len(y)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        grads = dict(model.named_parameters())
        total = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in grads.values()))
        assert signals.values["grad-norm"][i] == pytest.approx(total, rel=1e-5)
        for layer, names in layers.items():
            expected = math.sqrt(sum(float(grads[n].grad.pow(2).sum()) for n in names))
            assert signals.per_layer[PER_LAYER_PREFIX + layer][i] == pytest.approx(expected, rel=1e-5)


def test_signals_do_not_depend_on_the_batch_size() -> None:
    model, x, y = model_and_records("convnet", n=9)
    one = compute_signals(model, x, y, ["loss", "grad-norm"], batch_size=2).values
    other = compute_signals(model, x, y, ["loss", "grad-norm"], batch_size=64).values
    for name in one:
        np.testing.assert_allclose(one[name], other[name], rtol=1e-5)


def test_orientation_makes_members_score_higher() -> None:
    values = np.array([0.1, 2.0])
    assert list(oriented("loss", values)) == [-0.1, -2.0]
    assert list(oriented("grad-norm", values)) == [-0.1, -2.0]
    assert list(oriented("confidence", values)) == [0.1, 2.0]
    assert list(oriented("logit-confidence", values)) == [0.1, 2.0]
