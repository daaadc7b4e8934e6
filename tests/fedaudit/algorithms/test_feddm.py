"""FedDM: networks sampled on the sphere around the global model, the embedding at the last linear layer's input,
synthetic class means driven to the real ones, the server inside the ball, exact resume, and its bad options."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import FAST_ARGS, assert_user_error, engine_independent_digest, interrupt_in_round

from fedaudit.algorithms.base import RoundContext, flat_distance
from fedaudit.algorithms.feddm import FedDM, _embed, _last_linear, sphere_sample
from fedaudit.config import DataConfig, FedDMConfig, FederatedConfig, ModelConfig, RunConfig
from fedaudit.models import ModelSpec, build_model, initial_params
from fedaudit.preparation import client_data, prepare


def test_networks_are_sampled_on_the_sphere_of_radius_rho_in_every_direction() -> None:
    spec = ModelSpec("convnet", (1, 8, 8), 10, width=4, depth=2)
    center = initial_params(spec, 0)
    generator = torch.Generator().manual_seed(0)
    samples = [sphere_sample(center, 2.5, generator) for _ in range(400)]
    assert all(flat_distance(s, center) == pytest.approx(2.5, rel=1e-6) for s in samples)
    mean_offset = {name: torch.stack([s[name] - center[name] for s in samples]).mean(0) for name in center}
    assert flat_distance(mean_offset, {n: torch.zeros_like(p) for n, p in center.items()}) < 2.5 * 0.1


def test_the_embedding_is_the_input_of_the_last_linear_layer() -> None:
    model = build_model(ModelSpec("convnet", (1, 8, 8), 10, width=4, depth=2))
    params = {name: p.detach() for name, p in model.named_parameters()}
    x = torch.randn(3, 1, 8, 8)
    embedding, logits = _embed(model, _last_linear(model), params, x)
    torch.testing.assert_close(embedding, torch.flatten(model.features(x), 1))
    torch.testing.assert_close(logits, model(x))


def test_distribution_matching_drives_each_class_mean_of_the_synthetic_set_to_the_real_one() -> None:
    """With a linear model the loss is ||m_real - m_syn||^2 + ||W (m_real - m_syn)||^2 per class: the synthetic
    class means must end near the real class means (up to the noise of the sampled real batches)."""

    def matched(iterations: int, lr: float):
        config = RunConfig(
            device="cpu",
            data=DataConfig(num_clients=3),
            model=ModelConfig(arch="mlp", width=16, depth=0),
            federated=FederatedConfig(algorithm="feddm", rounds=1),
            feddm=FedDMConfig(dm_ipc=5, dm_iterations=iterations, dm_lr=lr, dm_batch=64),
        )
        setup = prepare(config)
        data = client_data(setup, 0)
        ctx = RoundContext(0, 1, setup.config, torch.device("cpu"))
        message = FedDM(setup.config).client_update(
            build_model(setup.spec), initial_params(setup.spec, 0), data, ctx, torch.Generator().manual_seed(1)
        )
        return message, data

    start, _ = matched(1, 1e-12)  # the same real images the set starts from, not moved
    message, data = matched(200, 0.2)
    assert message.metrics["matching_loss_last"] < 0.5 * message.metrics["matching_loss_first"]  # floor: batch noise
    labels = message.payload["labels"]
    for c in torch.unique(labels):
        real = data.x[data.y == c].mean(0)
        before = (start.payload["images"][labels == c].mean(0) - real).norm()
        after = (message.payload["images"][labels == c].mean(0) - real).norm()
        assert after < 0.35 * before


FEDDM_ARGS = (*FAST_ARGS, "--algorithm", "feddm", "--dm-ipc", "3", "--dm-iterations", "5", "--server-epochs", "5")


def test_a_feddm_run_stays_in_the_ball_and_resumes_to_the_same_bytes(tmp_path, cli, monkeypatch):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    args = (*FEDDM_ARGS, "--rounds", "2", "--dm-radius", "0.5", "--save-transmitted")
    result = cli("train", *args, "--out", full)
    assert result.exit_code == 0, result.output
    for round_number in (1, 2):
        server = json.loads((full / "checkpoints" / f"round-000{round_number}.json").read_text())["server"]
        assert server["server_iterations"] >= 1
        # 30 synthetic images, one batch an epoch, 5 epochs: it leaves the ball of radius 0.5 or runs out of epochs
        assert server["server_distance"] >= 0.5 or server["server_iterations"] == 5
    interrupt_in_round(monkeypatch, 2)
    assert cli("train", *args, "--out", resumed).exit_code == 1
    monkeypatch.undo()
    assert cli("train", "--resume", resumed, "--no-progress").exit_code == 0
    assert engine_independent_digest(resumed) == engine_independent_digest(full)


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (("--algorithm", "feddm", "--dp"), "runs without DP"),
        (("--algorithm", "fedavg", "--dm-ipc", "2"), "--algorithm feddm"),
        (("--algorithm", "feddm", "--dm-radius", "0"), "--dm-radius"),
        (("--algorithm", "feddm", "--dm-iterations", "0"), "--dm-iterations"),
    ],
)
def test_bad_feddm_options_are_one_sentence(tmp_path, cli, extra, mentions):
    assert_user_error(cli("train", *FAST_ARGS, *extra, "--out", tmp_path / "run"), mentions=mentions)
    assert not (tmp_path / "run").exists()
