"""Gradient-sharing baselines: FedAvg/FedProx/FedSGD against plain SGD and against each other."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from fedaudit.algorithms.base import ClientData, RoundContext, clone_params, get_algorithm, run_client
from fedaudit.config import FederatedConfig, PrivacyConfig, RunConfig
from fedaudit.models import ModelSpec, build_model
from fedaudit.privacy.primitive import dp_gradient, poisson_sample
from fedaudit.privacy.randomness import SeededKeys

SPEC = ModelSpec("convnet", (1, 8, 8), 10, width=4, depth=2)


def _setup(n: int = 24, seed: int = 0):
    torch.manual_seed(seed)
    model = build_model(SPEC).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(n, 1, 8, 8, dtype=torch.float64)
    y = torch.randint(0, 10, (n,))
    return model, params, ClientData(0, x, y)


def _config(**federated) -> RunConfig:
    return RunConfig(federated=FederatedConfig(**federated)).resolved()


def _round(config: RunConfig, model, params, clients, seed: int = 0):
    algorithm = get_algorithm(config)
    ctx = RoundContext(round=0, rounds=config.federated.rounds, config=config, device=torch.device("cpu"))
    messages = [run_client(algorithm, model, params, data, ctx, SeededKeys(seed, data.client_id)) for data in clients]
    return algorithm.server_update(model, params, messages, ctx, torch.Generator().manual_seed(99)).params, messages


def test_fedavg_one_client_one_step_equals_sgd() -> None:
    model, params, data = _setup()
    config = _config(algorithm="fedavg", local_epochs=1, batch_size=data.num_examples, client_lr=0.3)
    new, _ = _round(config, model, params, [data])
    reference = build_model(SPEC).double()
    reference.load_state_dict(params)
    F.cross_entropy(reference(data.x), data.y).backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(new[name], params[name] - 0.3 * p.grad)


def test_dp_fedavg_one_client_one_step_equals_dp_sgd_step() -> None:
    model, params, data = _setup(n=40)
    config = replace(
        _config(algorithm="fedavg", local_epochs=1, batch_size=40, client_lr=0.5),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0, max_grad_norm=0.2),
    )
    new, messages = _round(config, model, params, [data], seed=3)
    generator = SeededKeys(3, 0).query_source(0, 0, "cpu")  # the first DP query of client 0 in round 0
    idx = poisson_sample(40, 1.0, generator=generator)
    reference = build_model(SPEC).double()
    reference.load_state_dict(params)
    step = dp_gradient(
        reference,
        data.x[idx],
        data.y[idx],
        noise_multiplier=1.0,
        max_grad_norm=0.2,
        expected_batch_size=40,
        generator=generator,
    )
    for name in params:
        torch.testing.assert_close(new[name], params[name] - 0.5 * step.grads[name])
    assert [(e.noise_multiplier, e.sample_rate, e.steps) for e in messages[0].privacy_events] == [(1.0, 1.0, 1)]


def test_fedprox_with_mu_zero_equals_fedavg_and_mu_pulls_towards_global() -> None:
    model, params, data = _setup(n=64)
    clients = [data, ClientData(1, data.x.flip(0), data.y.flip(0))]
    common = {"batch_size": 16, "local_epochs": 2, "client_lr": 0.1}  # lr * mu < 2: the prox step contracts
    avg, _ = _round(_config(algorithm="fedavg", **common), model, params, clients)
    prox0, _ = _round(_config(algorithm="fedprox", mu=0.0, **common), model, params, clients)
    prox, _ = _round(_config(algorithm="fedprox", mu=5.0, **common), model, params, clients)
    for name in params:
        torch.testing.assert_close(avg[name], prox0[name], rtol=0, atol=0)

    def dist(a):
        return sum(float((a[k] - params[k]).pow(2).sum()) for k in params) ** 0.5

    assert dist(prox) < dist(avg)


def test_dp_fedprox_adds_prox_gradient_after_the_noise() -> None:
    """With a huge mu the update is dominated by the prox term, which is not clipped away."""
    model, params, data = _setup(n=32)
    base = replace(
        _config(algorithm="fedprox", mu=0.0, batch_size=8, local_epochs=1, client_lr=0.1),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0, max_grad_norm=0.2),
    )
    plain, _ = _round(base, model, params, [data], seed=1)
    with_prox, _ = _round(replace(base, federated=replace(base.federated, mu=2.0)), model, params, [data], seed=1)
    # Same noise and batches: the prox term (which would vanish if it were clipped with the data
    # gradient) must make a difference and shrink the step.
    d_plain = sum(float((plain[k] - params[k]).pow(2).sum()) for k in params)
    d_prox = sum(float((with_prox[k] - params[k]).pow(2).sum()) for k in params)
    assert d_prox < d_plain


def test_fedsgd_is_one_full_batch_step_and_server_weights_by_size() -> None:
    model, params, data = _setup(n=30)
    small = ClientData(1, data.x[:10], data.y[:10])
    config = _config(algorithm="fedsgd", client_lr=0.2, server_lr=1.0)
    new, messages = _round(config, model, params, [data, small])
    assert [m.metrics["local_steps"] for m in messages] == [1.0, 1.0]
    expected = clone_params(params)
    for weight, msg in zip((30 / 40, 10 / 40), messages):
        for k in expected:
            expected[k] += weight * msg.payload[k]
    for k in params:
        torch.testing.assert_close(new[k], expected[k])
    uniform = replace(config, federated=replace(config.federated, weighting="uniform"))
    new_uniform, _ = _round(uniform, model, params, [data, small])
    assert any(not torch.allclose(new_uniform[k], new[k]) for k in params)


def test_dp_query_count_is_epochs_times_batches() -> None:
    config = replace(
        _config(algorithm="fedavg", batch_size=10, local_epochs=3),
        privacy=PrivacyConfig(dp=True, noise_multiplier=1.0, max_grad_norm=1.0),
    )
    algorithm = get_algorithm(config)
    assert algorithm.queries_per_round(config, 105) == 3 * 10
    model, params, data = _setup(n=105)
    _, messages = _round(config, model, params, [data])
    assert messages[0].privacy_events[0].steps == 30
    assert messages[0].privacy_events[0].sample_rate == 10 / 105
