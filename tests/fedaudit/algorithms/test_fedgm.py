"""FedGM: every synthetic image released exactly once over the stages, the labels through the configured label-DP
mechanism with the right prior, nothing private kept on the server's side, exact resume, and its bad options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import FAST_ARGS, assert_user_error, engine_independent_digest, interrupt_in_round, with_keys
from safetensors.torch import load_file
from torch.func import functional_call

from fedaudit.algorithms.base import RoundContext, run_client
from fedaudit.algorithms.fedgm import FedGM
from fedaudit.config import DataConfig, FederatedConfig, FedGMConfig, ModelConfig, RunConfig
from fedaudit.models import build_model, fresh_params, initial_params
from fedaudit.preparation import client_data, prepare
from fedaudit.privacy.labeldp import randomized_response, rr_with_prior
from fedaudit.privacy.randomness import SeededKeys

SMALL = ("--distill-ipc", "4", "--distill-iterations", "2", "--distill-steps", "3", "--server-steps", "30")
GM_ARGS = (*FAST_ARGS, "--algorithm", "fedgm", *SMALL)


def _setup(partition: str | None = None, **fedgm):
    config = RunConfig(
        device="cpu",
        data=DataConfig(num_clients=3) if partition is None else DataConfig(num_clients=3, partition=partition),
        model=ModelConfig(arch="mlp", width=16, depth=1),
        federated=FederatedConfig(algorithm="fedgm", rounds=2),
        fedgm=FedGMConfig(distill_ipc=4, distill_iterations=2, distill_steps=3, server_steps=30, **fedgm),
    )
    return prepare(config)


def test_every_synthetic_image_is_released_once_over_the_stages_with_labels_in_clear() -> None:
    setup = _setup()
    algorithm, model = FedGM(setup.config), build_model(setup.spec)
    params = initial_params(setup.spec, 0)
    data = client_data(setup, 1)
    sent = []
    for m in range(2):
        ctx = RoundContext(m, 2, setup.config, torch.device("cpu"))
        message = run_client(algorithm, model, params, data, ctx, SeededKeys(0, 1))
        assert not message.state  # nothing is kept by the client, so nothing reaches the server's checkpoints
        sent.append(message.payload)
    images = torch.cat([p["images"] for p in sent])
    labels = torch.cat([p["labels"] for p in sent])
    classes = torch.unique(data.y)
    assert len(labels) == 4 * len(classes) and all(len(p["labels"]) == 4 * len(classes) // 2 for p in sent)
    assert torch.equal(labels.sort().values, classes.repeat_interleave(4))  # balanced, in clear
    assert len(torch.unique(images, dim=0)) == len(images)  # no image sent twice
    again = FedGM(setup.config)._synthetic_set(  # a fresh process
        build_model(setup.spec), params, with_keys(data, SeededKeys(0, 1)), ctx
    )
    assert torch.equal(torch.cat([again[0][again[2] == m] for m in range(2)]), images)


def test_the_stage_split_never_looks_at_the_labels() -> None:
    """The same data with its classes renamed gives the same stage to every synthetic image position."""
    setup = _setup()
    data = client_data(setup, 0)
    renamed = type(data)(0, data.x, (data.y + 3) % 10)
    ctx = RoundContext(0, 2, setup.config, torch.device("cpu"))
    params = initial_params(setup.spec, 0)
    model = build_model(setup.spec)
    stages = [
        FedGM(setup.config)._synthetic_set(model, params, with_keys(d, SeededKeys(0, 0)), ctx)[2]
        for d in (data, renamed)
    ]
    assert torch.equal(*stages)


def test_a_stages_images_are_sent_in_an_order_that_does_not_follow_their_labels() -> None:
    """The set is distilled class by class; sent in that order, each position would tell its image's class, and
    the randomized labels could be decoded by a vote over the positions of each class."""
    setup = _setup("iid")
    algorithm, model = FedGM(setup.config), build_model(setup.spec)
    params, data = initial_params(setup.spec, 0), client_data(setup, 0)
    for m in range(2):
        labels = run_client(algorithm, model, params, data, _ctx(setup, m), SeededKeys(0, 0)).payload["labels"]
        assert len(torch.unique(labels)) > 3
        assert not torch.equal(labels, labels.sort().values) and not torch.equal(labels, labels.sort().values.flip(0))
        runs = 1 + int((labels[1:] != labels[:-1]).sum())
        assert runs > len(labels) // 2, labels  # 4 images a class in a row otherwise: about one run per class


def test_labels_go_through_rr_then_rr_with_prior_from_the_server_model() -> None:
    setup = _setup(label_epsilon=1.0)
    algorithm, model = FedGM(setup.config), build_model(setup.spec)
    data, keys = client_data(setup, 2), SeededKeys(0, 2)
    images, labels, stage, _ = algorithm._synthetic_set(
        model, initial_params(setup.spec, 0), with_keys(data, keys), _ctx(setup, 0)
    )
    for m in range(2):
        params = fresh_params(model, initial_params(setup.spec, 0), torch.Generator().manual_seed(m))
        message = run_client(algorithm, model, params, data, _ctx(setup, m), keys)
        true = labels[stage == m]
        assert torch.equal(message.payload["images"], images[stage == m])
        generator = keys.query_source(m, 0, "cpu")  # the round's one label query
        if m == 0:  # no earlier stage: a uniform prior, plain RR
            expected = randomized_response(true, 10, 1.0, generator)
        else:
            with torch.no_grad():
                prior = F.softmax(functional_call(model, params, (images[stage == m],)), dim=1).double()
            expected = rr_with_prior(true, prior, 1.0, generator)
        assert torch.equal(message.payload["labels"], expected)


def _ctx(setup, m: int) -> RoundContext:
    return RoundContext(m, 2, setup.config, torch.device("cpu"))


def test_a_fedgm_run_keeps_only_what_was_sent_and_resumes_to_the_same_bytes(tmp_path, cli, monkeypatch, fixed_secrets):
    args = (*GM_ARGS, "--rounds", "2", "--label-epsilon", "2", "--save-transmitted")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    result = cli("train", *args, "--out", full)
    assert result.exit_code == 0, result.output
    assert "no record-level DP, labels 2-label-DP" in result.output
    assert not list((full / "checkpoints").glob("*-clients.safetensors"))  # no true labels, no unsent stage
    assert not (full / "privacy.json").exists()  # no record-level DP ledger: FedGM has no record-level guarantee
    kept = load_file(full / "checkpoints" / "round-0002-server-kept.safetensors")
    sent = [load_file(f) for r in (1, 2) for f in sorted((full / "transmitted" / f"round-000{r}").glob("*"))]
    assert torch.equal(kept["labels"], torch.cat([s["labels"] for s in sent]))  # the server holds what it got
    interrupt_in_round(monkeypatch, 2)
    assert cli("train", *args, "--out", resumed).exit_code == 1
    monkeypatch.undo()
    assert cli("train", "--resume", resumed, "--no-progress").exit_code == 0
    assert engine_independent_digest(resumed) == engine_independent_digest(full)
    report = cli("report", full, "--out", tmp_path / "report.md")
    assert report.exit_code == 0, report.output
    text = (tmp_path / "report.md").read_text()
    assert "label DP, epsilon 2 (rr-with-prior)" in text and "not protected" in text and "not comparable" in text
    assert "the label of one synthetic image sent" in text and "not the training records, features or labels" in text
    assert cli("report", full, "--out", tmp_path / "report.html", "--overwrite").exit_code == 0  # summaries beside
    html = (tmp_path / "report.html").read_text()
    assert "Round 1: the synthetic sets of every client" in html and "Round 2: the synthetic sets" in html


@pytest.mark.parametrize(
    ("extra", "mentions"),
    [
        (("--algorithm", "fedgm", "--dp"), "label DP"),
        (("--algorithm", "fedgm", "--client-fraction", "0.5"), "--client-fraction 1"),
        (("--algorithm", "fedavg", "--label-epsilon", "1"), "--algorithm fedgm"),
        (("--algorithm", "fedgm", "--label-epsilon", "0"), "--label-epsilon"),
        (("--algorithm", "fedgm", "--top-k", "2"), "--top-k"),
        (("--algorithm", "fedgm", "--label-mechanism", "rr-top-k"), "--top-k"),
        (("--algorithm", "fedgm", "--distill-ipc", "0"), "--distill-ipc"),
    ],
)
def test_bad_fedgm_options_are_one_sentence(tmp_path, cli, extra, mentions):
    assert_user_error(cli("train", *FAST_ARGS, *extra, "--out", tmp_path / "run"), mentions=mentions)
    assert not (tmp_path / "run").exists()


def test_nearest_distance_equals_the_loop() -> None:
    from fedaudit.attacks.membership.signals import nearest_distance

    generator = torch.Generator().manual_seed(0)
    x, synthetic = torch.randn(7, 1, 4, 4, generator=generator), torch.randn(5, 1, 4, 4, generator=generator)
    expected = [min(float((a.double() - b.double()).pow(2).sum().sqrt()) for b in synthetic) for a in x]
    assert nearest_distance(x, synthetic, batch_size=3).tolist() == pytest.approx(expected, rel=1e-12)


def test_the_synthetic_distance_attack_finds_the_records_a_synthetic_set_started_from(tmp_path, cli):
    """FedGM's images start from real records and barely move in 2 x 3 matching steps: the server's view gives
    those records away (every one of the 5 best-scored records is a member); on model updates the signal is refused
    with one sentence."""
    import pandas as pd

    run = tmp_path / "gm"
    result = cli("train", *GM_ARGS, "--rounds", "1", "--distill-lr", "0.01", "--save-transmitted", "--out", run)
    assert result.exit_code == 0, result.output
    result = cli("attack", run, "--signal", "synthetic-distance", "--method", "threshold", "--no-progress")
    assert result.exit_code == 0, result.output
    scores = pd.read_csv(run / "attacks" / "synthetic-distance-threshold" / "scores.csv")
    assert (scores.nlargest(5, "score")["member"] == 1).all()
    plain = tmp_path / "avg"
    assert cli("train", *FAST_ARGS, "--rounds", "1", "--save-transmitted", "--out", plain).exit_code == 0
    refused = cli("attack", plain, "--signal", "synthetic-distance", "--method", "threshold", "--no-progress")
    assert_user_error(refused, mentions="model updates")
