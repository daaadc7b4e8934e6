"""Canary scores against a slow, obviously correct loop over canaries and rounds, read straight from the run
directory: the right client's payloads, the model each round started from, the sign, the normalisation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_ARGS, invoke
from safetensors.torch import load_file

from fedaudit.data import load_dataset
from fedaudit.instruments.canaries import Canaries, canary_directions
from fedaudit.models import build_model
from fedaudit.rundir import RunDirectory


def _train_and_attack(out: Path, *extra: str) -> RunDirectory:
    result = invoke("train", *FAST_ARGS, "--dp", "--rounds", "2", "--client-fraction", "0.6", *extra, "--out", out)
    assert result.exit_code == 0, result.output
    result = invoke("attack", out, "--method", "canary", "--no-progress")
    assert result.exit_code == 0, result.output
    return RunDirectory(out)


def _round_start(run: RunDirectory, round_number: int) -> dict[str, torch.Tensor]:
    if round_number > 1:
        return load_file(str(run.checkpoints.path(round_number - 1)))
    from fedaudit.models import initial_params

    return initial_params(run.model_spec(), run.read_run_config().seed)


def _slow_scores(run: RunDirectory, kind: str) -> np.ndarray:
    """score_i = sum over rounds t, if canary i's client sent something in t, of <v, d_i^t>, one canary at a time."""
    canaries = Canaries.from_arrays(dict(np.load(run.canaries_path)))
    model = build_model(run.model_spec())
    names = [name for name, _ in model.named_parameters()]
    shapes = {name: p.shape for name, p in model.named_parameters()}
    dataset = load_dataset("digits")
    scores = np.zeros(canaries.count)
    for i in range(canaries.count):
        for round_number in (1, 2):
            file = (
                run.transmitted_dir / f"round-{round_number:04d}" / f"client-{int(canaries.client[i]):03d}.safetensors"
            )
            if not file.is_file():
                continue
            sent = load_file(str(file))
            start = _round_start(run, round_number)
            if "images" in sent:
                params = {n: start[n].clone().requires_grad_(True) for n in names}
                loss = F.cross_entropy(torch.func.functional_call(model, params, (sent["images"],)), sent["labels"])
                g = torch.cat([t.flatten() for t in torch.autograd.grad(loss, [params[n] for n in names])]).double()
                v = g / g.norm()
            else:
                v = -torch.cat([sent[n].flatten() for n in names]).double()
            if kind == "gradient":
                u = canary_directions(canaries.seed, np.array([i]), shapes, layout=canaries.layout)
                d = torch.cat([u[n].flatten() for n in names]).double()
            else:
                params = {n: start[n].clone().requires_grad_(True) for n in names}
                x = dataset.train_x[int(canaries.record[i])].unsqueeze(0)
                y = torch.tensor([int(canaries.label[i])])
                loss = F.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
                g = torch.cat([t.flatten() for t in torch.autograd.grad(loss, [params[n] for n in names])]).double()
                d = g / g.norm()
            scores[i] += float(v @ d)
    return scores


@pytest.mark.parametrize(
    "kind, algorithm, folder",
    [
        ("gradient", "fedavg", "update-projection-canary"),
        ("input", "fedavg", "update-projection-canary"),
        ("gradient", "fedlap", "synthetic-gradient-canary"),
    ],
)
def test_wire_scores_equal_a_slow_loop(tmp_path, kind, algorithm, folder):
    extra = ["--canaries", "40", "--canary-kind", kind, "--algorithm", algorithm]
    if algorithm == "fedlap":
        extra += ["--trajectories", "1", "--max-loops", "1", "--real-batches", "2", "--image-steps", "2"]
    run = _train_and_attack(tmp_path / "run", *extra)
    table = pd.read_csv(run.attacks_dir / folder / "scores.csv")
    expected = _slow_scores(run, kind)
    assert np.abs(expected).max() > 0
    np.testing.assert_allclose(table["score"].to_numpy(), expected, rtol=1e-6, atol=1e-9)


def test_input_canaries_are_scored_by_their_final_loss_and_leave_the_non_member_pool(tmp_path):
    run = _train_and_attack(tmp_path / "run", "--canaries", "40", "--canary-kind", "input")
    canaries = Canaries.from_arrays(dict(np.load(run.canaries_path)))
    table = pd.read_csv(run.attacks_dir / "loss-canary" / "scores.csv")
    model = run.load_model(None)
    dataset = load_dataset("digits")
    for i in (0, 17, 39):
        x = dataset.train_x[int(canaries.record[i])].unsqueeze(0)
        with torch.no_grad():
            loss = F.cross_entropy(model(x), torch.tensor([int(canaries.label[i])]))
        assert table["score"][i] == pytest.approx(-float(loss), rel=1e-6)
        assert table["record"][i] == canaries.record[i] and table["label"][i] == canaries.label[i]
    assert invoke("attack", run.path, "--nonmembers", "holdout", "--no-progress").exit_code == 0
    scores = pd.read_csv(run.attacks_dir / "loss-threshold" / "scores.csv")
    nonmembers = scores[(scores["member"] == 0) & (scores["source"] == "train")]
    assert len(nonmembers) > 50 and not set(nonmembers["record"]) & set(canaries.record.tolist())


def test_input_canaries_are_distinct_held_out_records_with_another_class_of_their_client():
    labels = np.repeat(np.arange(4), 50)
    holdout = np.arange(0, 200, 2)
    classes = [np.array([0, 1]), np.array([2, 3]), np.array([3])]
    canaries = Canaries.draw(
        count=80, kind="input", seed=3, num_clients=3, holdout=holdout, labels=labels, client_classes=classes
    )
    assert len(set(canaries.record.tolist())) == 80 and np.isin(canaries.record, holdout).all()
    assert (canaries.label != labels[canaries.record]).all()
    for i in range(80):
        own, k = labels[canaries.record[i]], canaries.client[i]
        others = classes[k][classes[k] != own]
        if others.size:
            assert canaries.label[i] in others
    again = Canaries.draw(
        count=80, kind="input", seed=3, num_clients=3, holdout=holdout, labels=labels, client_classes=classes
    )
    assert all(np.array_equal(a, b) for a, b in zip(canaries.to_arrays().values(), again.to_arrays().values()))
    restored = Canaries.from_arrays(canaries.to_arrays())
    assert np.array_equal(restored.record, canaries.record) and np.array_equal(restored.label, canaries.label)
