"""Fedssyn: the shuffle deals every generated record to exactly one client, the generation round follows the
client's class frequencies, the ledger charges both phases, and a run resumes to the same bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import FAST_ARGS, assert_user_error, engine_independent_digest, interrupt_in_round
from safetensors.torch import load_file

from fedaudit.algorithms.base import ClientData, ClientMessage, RoundContext, run_client
from fedaudit.algorithms.fedssyn import SYNTHETIC, Fedssyn
from fedaudit.config import DataConfig, FederatedConfig, FedssynConfig, RunConfig
from fedaudit.models import ModelSpec, build_model, initial_params
from fedaudit.privacy.accounting import SGMEvent, compute_epsilon
from fedaudit.privacy.randomness import SeededKeys
from fedaudit.training import _at_least

SSYN_ARGS = (*FAST_ARGS, "--algorithm", "fedssyn", "--generator-epochs", "2", "--synthetic-per-client", "40")


def _config(clients: int = 4, per_client: int = 6, **fedssyn) -> RunConfig:
    return RunConfig(
        data=DataConfig(num_clients=clients),
        federated=FederatedConfig(algorithm="fedssyn", rounds=3),
        fedssyn=FedssynConfig(synthetic_per_client=per_client, **fedssyn),
    ).resolved()


def test_the_shuffle_deals_every_generated_record_to_exactly_one_client() -> None:
    config = _config()
    clients, per_client = 4, 6
    messages = [  # record r of client k is the image filled with 100 k + r; its label rides along
        ClientMessage(
            client_id=k,
            num_examples=10,
            payload={
                "images": (100.0 * k + torch.arange(per_client, dtype=torch.float32))
                .view(-1, 1, 1, 1)
                .expand(-1, 1, 2, 2),
                "labels": torch.full((per_client,), k),
            },
        )
        for k in reversed(range(clients))  # the arrival order does not matter
    ]
    ctx = RoundContext(0, 3, config, torch.device("cpu"))
    params = {"w": torch.zeros(2)}
    result = Fedssyn(config).server_update(None, params, messages, ctx, torch.Generator().manual_seed(0))
    assert torch.equal(result.params["w"], params["w"])  # the generation round leaves the model as it was
    assert set(result.dealt) == set(range(clients))
    tags = []
    for share in result.dealt.values():
        images, labels = share[f"{SYNTHETIC}images"], share[f"{SYNTHETIC}labels"]
        assert len(labels) == per_client
        tag = images[:, 0, 0, 0]
        assert torch.equal(labels, (tag // 100).long())  # every label stayed with its image
        assert (images == tag.view(-1, 1, 1, 1)).all()
        tags += tag.tolist()
    assert sorted(tags) == sorted(100.0 * k + r for k in range(clients) for r in range(per_client))
    assert any((result.dealt[k][f"{SYNTHETIC}labels"] != k).any() for k in range(clients))  # shuffled, not returned


def test_the_generated_labels_follow_the_class_frequencies_of_the_drawn_records() -> None:
    config = _config(per_client=40, generator_fraction=1.0, generator_epochs=1, generator_batch=8)
    spec = ModelSpec(arch="mlp", input_shape=(1, 8, 8), num_classes=10, width=8, depth=1)
    model = build_model(spec)
    y = torch.tensor([2] * 30 + [7] * 10)
    data = ClientData(client_id=1, x=torch.randn(40, 1, 8, 8), y=y)
    ctx = RoundContext(0, 3, config, torch.device("cpu"))
    message = run_client(Fedssyn(config), model, initial_params(spec, 0), data, ctx, SeededKeys(0, 1))
    assert torch.bincount(message.payload["labels"], minlength=10).tolist() == [0, 0, 30, 0, 0, 0, 0, 10, 0, 0]
    assert message.payload["images"].shape == (40, 1, 8, 8)
    assert message.privacy_events == []  # without DP nothing is charged


def test_a_fedssyn_run_deals_once_trains_on_real_plus_shuffled_and_resumes_to_the_same_bytes(
    tmp_path, cli, monkeypatch
):
    args = (*SSYN_ARGS, "--rounds", "3", "--client-fraction", "0.6", "--save-transmitted")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = cli("train", *args, "--out", full)
    assert result.exit_code == 0, result.output
    sent = sorted((full / "transmitted" / "round-0001").glob("client-*.safetensors"))
    assert len(sent) == 5  # every client generates in the first round, whatever --client-fraction says
    generated = torch.cat([load_file(f)["images"] for f in sent])
    kept = load_file(full / "checkpoints" / "round-0001-clients.safetensors")
    shares = [kept[f"client{k}/{SYNTHETIC}images"] for k in range(5)]
    assert all(len(share) == 40 for share in shares)
    key = lambda t: sorted(map(tuple, t.flatten(1).tolist()))  # noqa: E731
    assert key(torch.cat(shares)) == key(generated)  # every generated record dealt exactly once
    first = load_file(full / "checkpoints" / "round-0001.safetensors")
    assert all(torch.equal(first[n], p) for n, p in initial_params_of(full).items())  # the model did not move
    checkpoint = json.loads((full / "checkpoints" / "round-0002.json").read_text())
    assert len(checkpoint["clients"]) == 3 and all(c["synthetic_records"] == 40 for c in checkpoint["clients"])
    interrupt_in_round(monkeypatch, 3)
    assert cli("train", *args, "--out", resumed).exit_code == 1
    monkeypatch.undo()
    assert cli("train", "--resume", resumed, "--no-progress").exit_code == 0
    assert engine_independent_digest(resumed) == engine_independent_digest(full)
    attack = cli("attack", full, "--signal", "synthetic-distance", "--signal", "loss", "--no-progress")
    assert attack.exit_code == 0, attack.output  # the generated records of round 1 are the server's view
    assert len(list((full / "attacks").glob("*synthetic-distance*"))) >= 1


def initial_params_of(run) -> dict[str, torch.Tensor]:
    config = json.loads((run / "config.json").read_text())
    manifest = json.loads((run / "manifest.json").read_text())["model"]
    spec = ModelSpec(
        arch=manifest["arch"],
        input_shape=tuple(manifest["input_shape"]),
        num_classes=manifest["num_classes"],
        width=manifest["width"],
        depth=manifest["depth"],
    )
    return initial_params(spec, config["seed"])


def test_dp_fedssyn_charges_the_counts_the_generator_and_the_inner_steps_on_the_same_records(tmp_path, cli):
    out = tmp_path / "run"
    args = (*SSYN_ARGS, "--rounds", "3", "--dp", "--noise-multiplier", "1.2", "--generator-batch", "16")
    result = cli("train", *args, "--out", out)
    assert result.exit_code == 0, result.output
    ledger = json.loads((out / "privacy.json").read_text())
    sizes = json.loads((out / "manifest.json").read_text())["clients"]["num_examples"]
    batch = json.loads((out / "config.json").read_text())["federated"]["batch_size"]
    worst = 0.0
    for k, n in enumerate(sizes):
        m = int(0.75 * n)
        expected = [
            SGMEvent(1.2, 1.0, 1),  # the class counts: one Gaussian query over all records
            SGMEvent(1.2, 16 / m, 2 * (m // 16)),  # the generator's DP-SGD on its m records
            SGMEvent(1.2, batch / (n + 40), 2 * (n // batch)),  # 2 inner rounds of 1 epoch of the real records
        ]
        entries = [
            SGMEvent(e["noise_multiplier"], e["sample_rate"], e["steps"])
            for e in ledger["per_client"][str(k)]["entries"]
        ]
        assert entries == expected
        epsilon = compute_epsilon(expected, delta=1e-5)
        assert math.isclose(ledger["per_client"][str(k)]["epsilon"], epsilon, rel_tol=1e-12)
        worst = max(worst, epsilon)
    assert math.isclose(ledger["epsilon_per_round"][-1], worst, rel_tol=1e-12)
    without_generator = compute_epsilon([SGMEvent(1.2, batch / (sizes[0] + 40), 2 * (sizes[0] // batch))], delta=1e-5)
    assert worst > without_generator  # the generation round is not free
    report = cli("report", out, "--out", tmp_path / "report.md")
    assert report.exit_code == 0, report.output
    text = (tmp_path / "report.md").read_text()
    assert "covers both phases" in text and "adds the generation round" in text


def test_a_target_epsilon_covers_both_phases(tmp_path, cli):
    out = tmp_path / "run"
    result = cli("train", *SSYN_ARGS, "--rounds", "2", "--dp", "--target-epsilon", "20", "--out", out)
    assert result.exit_code == 0, result.output
    epsilon = json.loads((out / "privacy.json").read_text())["epsilon_per_round"][-1]
    assert 19.9 < epsilon <= 20.0


def test_a_client_that_reports_more_steps_than_planned_is_charged_them() -> None:
    planned = [SGMEvent(1.0, 1.0, 1), SGMEvent(1.0, 0.1, 10)]
    assert _at_least(planned, [SGMEvent(1.0, 0.1, 12)]) == [SGMEvent(1.0, 1.0, 1), SGMEvent(1.0, 0.1, 12)]
    assert _at_least(planned, [SGMEvent(1.0, 0.1, 3)]) == planned
    assert _at_least(planned, [SGMEvent(0.5, 0.1, 1)])[-1] == SGMEvent(0.5, 0.1, 1)


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (("--algorithm", "fedavg", "--generator-epochs", "3"), "--algorithm fedssyn"),
        (("--algorithm", "fedssyn", "--rounds", "1"), "--rounds 2"),
        (("--algorithm", "fedssyn", "--canaries", "4"), "--canaries needs --dp"),
        (("--algorithm", "fedssyn", "--generator-fraction", "0"), "--generator-fraction"),
        (("--algorithm", "fedssyn", "--synthetic-per-client", "0"), "--synthetic-per-client"),
        (("--algorithm", "fedssyn", "--generator-batch", "100000"), "--generator-batch"),
        (("--algorithm", "fedssyn", "--inner-algorithm", "fedlap"), "--inner-algorithm"),
    ],
)
def test_bad_fedssyn_options_are_one_sentence(tmp_path, cli, extra, mentions):
    assert_user_error(cli("train", *FAST_ARGS, "--rounds", "2", *extra, "--out", tmp_path / "run"), mentions=mentions)
    assert not (tmp_path / "run").exists()
