"""FedLAP / FedLAP-DP: matching loss, trust regions, loop counts, the shared DP primitive, synthesis."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from helpers import with_keys
from torch.func import functional_call

import fedaudit.algorithms.fedlap as fedlap_module
from fedaudit.algorithms.base import ClientData, RoundContext, flat_distance, get_algorithm
from fedaudit.algorithms.fedlap import FedLAP, _Matching, layer_distance, matched_names, matching_loss
from fedaudit.config import FederatedConfig, FedLAPConfig, PrivacyConfig, RunConfig
from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.randomness import SeededKeys

SPEC = ModelSpec("convnet", (1, 8, 8), 4, width=4, depth=2)


def _client(n: int = 64, seed: int = 0) -> tuple[torch.nn.Module, dict, ClientData]:
    torch.manual_seed(seed)
    model = build_model(SPEC)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(n, 1, 8, 8)
    y = torch.arange(n) % 2  # the client holds classes 0 and 1
    return model, params, with_keys(ClientData(0, x, y), SeededKeys(seed, 0))


def _config(dp: bool, **fedlap) -> RunConfig:
    privacy = PrivacyConfig(dp=True, noise_multiplier=1.0, max_grad_norm=1.0) if dp else PrivacyConfig()
    base = dict(ipc=2, trajectories=2, max_loops=3, real_batches=2, image_steps=2, model_epochs=1, server_epochs=5)
    base.update(fedlap)
    return RunConfig(
        federated=FederatedConfig(algorithm="fedlap", rounds=1, batch_size=16, client_lr=0.01),
        privacy=privacy,
        fedlap=FedLAPConfig(**base),
    ).resolved()


def _ctx(config: RunConfig) -> RoundContext:
    return RoundContext(round=0, rounds=config.federated.rounds, config=config, device=torch.device("cpu"))


def _matching(
    model: torch.nn.Module,
    params: dict,
    data: ClientData,
    config: RunConfig,
    images: torch.Tensor,
    labels: torch.Tensor,
    generator: torch.Generator,
    image_lr: float = 1.0,
) -> _Matching:
    """A client's matching work on ``images`` (made a leaf that requires grad) as client_update builds it."""
    images = images.detach().clone().requires_grad_(True)
    optimizer = torch.optim.SGD([images], lr=image_lr, momentum=0.5)
    return _Matching(
        model, params, data, _ctx(config), generator, images, labels, optimizer, lr=0.1,
        matched=matched_names(model, params),
    )  # fmt: skip


def _direct_layer_distance(real: torch.Tensor, syn: torch.Tensor) -> float:
    rows_r = [real.flatten().tolist()] if real.dim() == 1 else [r.flatten().tolist() for r in real]
    rows_s = [syn.flatten().tolist()] if syn.dim() == 1 else [r.flatten().tolist() for r in syn]
    total = 0.0
    for a, b in zip(rows_r, rows_s):
        dot = sum(u * v for u, v in zip(a, b))
        total += 1.0 - dot / (math.sqrt(sum(u * u for u in a)) * math.sqrt(sum(v * v for v in b)))
    return total if real.dim() == 1 else total / len(rows_r)


def test_matching_loss_matches_a_direct_per_row_computation() -> None:
    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 3, 3, 3), (7, 11), (6,)]
    real = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    syn = [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes]
    for r, s in zip(real, syn):
        assert float(layer_distance(r, s)) == pytest.approx(_direct_layer_distance(r, s), rel=1e-10)
    mse = sum(float((r - s).pow(2).sum()) for r, s in zip(real, syn))
    expected = sum(_direct_layer_distance(r, s) for r, s in zip(real, syn)) + 0.1 * mse
    assert float(matching_loss(real, syn, 0.1)) == pytest.approx(expected, rel=1e-10)


def test_matching_loss_is_zero_for_identical_and_scale_invariant_without_mse() -> None:
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=generator, dtype=torch.float64) for s in [(4, 2, 3, 3), (3, 8), (4,)]]
    assert float(matching_loss(grads, grads, 0.1)) == pytest.approx(0.0, abs=1e-12)
    other = [torch.randn_like(g) for g in grads]
    scaled = [7.5 * g for g in other]
    assert float(matching_loss(grads, scaled, 0.0)) == pytest.approx(float(matching_loss(grads, other, 0.0)), rel=1e-12)
    assert float(matching_loss(grads, scaled, 0.1)) != pytest.approx(float(matching_loss(grads, other, 0.1)), rel=1e-3)


def test_loop_counts_match_the_configuration_when_the_region_is_large() -> None:
    model, params, data = _client()
    config = _config(dp=True, radius=1e6)
    message = get_algorithm(config).client_update(model, params, data, _ctx(config), torch.Generator().manual_seed(0))
    lap = config.fedlap
    assert message.metrics["loops"] == lap.trajectories * lap.max_loops
    assert message.metrics["real_queries"] == lap.trajectories * lap.max_loops * lap.real_batches
    assert message.metrics["image_steps"] == lap.trajectories * lap.max_loops * lap.real_batches * lap.image_steps
    assert FedLAP().queries_per_round(config, data.num_examples) == lap.trajectories * lap.max_loops * lap.real_batches
    [event] = message.privacy_events
    assert (event.noise_multiplier, event.sample_rate, event.steps) == (1.0, 16 / 64, 12)
    assert message.payload["images"].shape == (2 * lap.ipc, 1, 8, 8)
    assert message.payload["labels"].tolist() == [0, 0, 1, 1]


def test_client_trust_region_ends_loops_and_is_exceeded_by_at_most_one_step() -> None:
    model, params, data = _client()
    config = _config(dp=False, radius=0.05, model_epochs=50, ipc=4, init="noise")
    config = replace(config, federated=replace(config.federated, client_lr=0.5))
    message = get_algorithm(config).client_update(model, params, data, _ctx(config), torch.Generator().manual_seed(0))
    lap = config.fedlap
    assert message.metrics["loops"] < lap.trajectories * lap.max_loops  # the region ended loops early
    assert message.metrics["radius"] <= lap.radius
    assert message.metrics["max_distance"] >= lap.radius  # it was reached, by one step that started inside
    assert message.metrics["max_last_step_start"] < lap.radius


def test_server_stops_at_the_radius_after_one_step_from_inside() -> None:
    model, params, data = _client()
    config = _config(dp=True, server_epochs=200, radius=0.3)
    config = replace(config, federated=replace(config.federated, client_lr=0.5))
    algorithm = get_algorithm(config)
    ctx = _ctx(config)
    messages = [algorithm.client_update(model, params, data, ctx, torch.Generator().manual_seed(k)) for k in range(2)]
    result = algorithm.server_update(model, params, messages, ctx, torch.Generator().manual_seed(9))
    m = result.metrics
    assert m["server_radius"] == pytest.approx(0.3)
    assert m["server_distance"] >= 0.3 > m["server_distance_before_last_step"]
    assert m["server_iterations"] < 200
    assert flat_distance(result.params, params) == pytest.approx(m["server_distance"], rel=1e-6)


def test_dp_target_comes_from_the_shared_primitive(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    original = fedlap_module.dp_gradient

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(fedlap_module, "dp_gradient", spy)
    model, params, data = _client()
    config = _config(dp=True, radius=1e6)
    tiny = replace(config, privacy=replace(config.privacy, noise_multiplier=0.0, max_grad_norm=1e-4))
    work = _matching(model, params, data, tiny, torch.zeros(2, 1, 8, 8), torch.tensor([0, 1]), torch.Generator())
    target = FedLAP()._real_gradient(work, params, seed=0)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in target))
    assert 0 < norm <= 1e-4 * (1 + 1e-5)  # clipped mean of a batch of at most B records over B
    get_algorithm(config).client_update(model, params, data, _ctx(config), torch.Generator().manual_seed(0))
    assert len(calls) == 1 + 12
    assert all(
        c["noise_multiplier"] == 1.0 and c["max_grad_norm"] == 1.0 and c["expected_batch_size"] == 16 for c in calls[1:]
    )


def test_image_updates_reduce_the_matching_loss_on_a_fixed_real_gradient() -> None:
    model, params, data = _client(n=128)
    leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    matched = matched_names(model, params)
    target = [
        g.detach()
        for g in torch.autograd.grad(
            F.cross_entropy(functional_call(model, leaves, (data.x,)), data.y), [leaves[n] for n in matched]
        )
    ]
    config = _config(dp=False)
    images = torch.randn(10, 1, 8, 8, generator=torch.Generator().manual_seed(3))
    labels = torch.tensor([0] * 5 + [1] * 5)
    algorithm = FedLAP()
    work = _matching(model, params, data, config, images, labels, torch.Generator())
    images = work.images
    losses = [algorithm._image_step(work, params, target, 0) for _ in range(150)]
    assert min(losses[-10:]) < 0.7 * losses[0]
    assert not torch.equal(images.detach(), torch.randn(10, 1, 8, 8, generator=torch.Generator().manual_seed(3)))


def test_init_real_is_refused_under_dp_and_previous_carries_the_set_over() -> None:
    from fedaudit.config import ConfigError

    with pytest.raises(ConfigError, match="init real"):
        _config(dp=True, init="real")
    model, params, data = _client()
    config = _config(dp=True, init="previous", radius=1e6)
    algorithm = get_algorithm(config)
    first = algorithm.client_update(model, params, data, _ctx(config), torch.Generator().manual_seed(0))
    fresh = algorithm._initial_set(data, _ctx(config), torch.Generator().manual_seed(5), first.state)
    torch.testing.assert_close(fresh.images, first.payload["images"])


def test_the_image_step_matches_no_rounding_noise_its_float32_gradient_is_the_float64_one() -> None:
    """The ConvNet's convolution biases feed per-channel normalisation, so their gradient is zero for every input.
    Computed in float32 it is rounding noise (about 1e-8), and its cosine in the matching loss is noise: matched, it
    moved the images' gradient by a quarter of its length against float64. Left out, float32 and float64 agree."""
    torch.manual_seed(0)
    model = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=32, depth=3))
    config = _config(dp=True, augment=False)
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(128, 1, 28, 28, generator=generator, dtype=torch.float64), torch.arange(128) % 2
    start = torch.randn(20, 1, 28, 28, generator=generator, dtype=torch.float64)
    noise = {
        n: torch.randn(p.shape, generator=generator, dtype=torch.float64) / 16 for n, p in model.named_parameters()
    }

    def image_gradient(dtype: torch.dtype, match_everything: bool) -> torch.Tensor:
        net = build_model(ModelSpec("convnet", (1, 28, 28), 10, width=32, depth=3)).to(dtype)
        params = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
        data = ClientData(0, x.to(dtype), y)
        work = _matching(net, params, data, config, start.to(dtype), torch.arange(20) % 2, torch.Generator())
        if match_everything:
            work = replace(work, matched=list(params))
        leaves = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        logits = functional_call(net, leaves, (x.to(dtype),))
        real = torch.autograd.grad(F.cross_entropy(logits, y), list(leaves.values()))
        target = {n: g + noise[n].to(dtype) for n, g in zip(params, real)}  # a noisy real gradient, as under DP
        FedLAP()._image_step(work, params, [target[n] for n in work.matched], seed=0)
        return work.images.grad.to(torch.float64)

    exact = image_gradient(torch.float64, match_everything=False)
    assert float((image_gradient(torch.float32, False) - exact).norm() / exact.norm()) < 1e-3
    matched_all = image_gradient(torch.float32, match_everything=True)  # the old step: noise moves the gradient
    assert float((matched_all - image_gradient(torch.float64, True)).norm() / exact.norm()) > 0.05
