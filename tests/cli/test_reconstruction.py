"""`fedaudit attack --method reconstruction` through the command line: what it writes (hashed like every attack
result), the same seed giving the same records, the report's section, grid and policy key, a synthetic-set run, and
`fedaudit compare --attack reconstruction`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import FAST_ARGS, invoke, read_json
from skimage.metrics import peak_signal_noise_ratio

from fedaudit.attacks.reconstruction.image_quality import pixel_range, to_pixels
from fedaudit.data import load_dataset
from fedaudit.rundir import RunDirectory, load_tensors

# FedSGD over 400 clients of three or four digits each, two of them a round: each update averages a few records
SMALL_CLIENTS = ("--algorithm", "fedsgd", "--partition", "iid", "--num-clients", "400", "--client-fraction", "0.005")
QUICK = ("--iterations", "40", "--restarts", "1")


@pytest.fixture(scope="module")
def attacked(tmp_path_factory) -> Path:
    """A two-round FedSGD run kept with --save-transmitted, attacked by reconstruction (default targets)."""
    run = tmp_path_factory.mktemp("recon") / "run"
    done = invoke("train", *FAST_ARGS, *SMALL_CLIENTS, "--rounds", "2", "--save-transmitted", "--out", run)
    assert done.exit_code == 0, done.output
    result = invoke("attack", run, "--method", "reconstruction", *QUICK, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "PSNR dB [95%]" in result.stdout and "random-update" in result.stdout
    return run


def _results(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "attacks").iterdir() if p.name.startswith("reconstruction-"))


def test_every_client_of_the_first_and_final_round_is_attacked_and_hashed(attacked) -> None:
    sent = {
        (int(r.name.split("-")[1]), int(c.stem.split("-")[1]))
        for r in (attacked / "transmitted").iterdir()
        for c in r.iterdir()
    }
    assert _results(attacked) == sorted(f"reconstruction-round-{r}-client-{c}" for r, c in sent)
    run = RunDirectory(attacked)
    assert run.seal.problems() == []
    files = read_json(attacked / "manifest.json")["files"]
    for name in _results(attacked):
        for file in ("records.csv", "images.safetensors", "metrics.json"):
            assert f"attacks/{name}/{file}" in files
        metrics = read_json(attacked / "attacks" / name / "metrics.json")
        assert (metrics["format"], metrics["method"], metrics["signal"]) == (
            "fedaudit-attack",
            "reconstruction",
            "update-inversion",
        )
        n = metrics["num_records"]
        assert (
            n == metrics["client_records"] == metrics["psnr"]["n"] == metrics["ssim"]["n"] == metrics["recovered"]["n"]
        )
        assert metrics["psnr"]["ci95"][0] <= metrics["psnr"]["mean"] <= metrics["psnr"]["ci95"][1]
        assert metrics["null"]["kind"] == "random-update" and metrics["null"]["psnr"]["n"] == n
        assert metrics["accountant_epsilon"] is None and metrics["settings"]["iterations"] == 40
        records = pd.read_csv(attacked / "attacks" / name / "records.csv")
        attack = records[records["kind"] == "update-inversion"]
        assert list(attack["psnr"]) == sorted(attack["psnr"], reverse=True)  # the worst case first
        assert attack["psnr"].mean() == pytest.approx(metrics["psnr"]["mean"])
        assert set(attack["record"]) <= set(np.load(attacked / "membership.npz")[f"client_{metrics['client']}"])
    # on a one-hidden-layer MLP the attack beats its null on every round, pooled over the clients
    for round_number in (1, 2):
        pooled = [
            read_json(attacked / "attacks" / name / "metrics.json")
            for name in _results(attacked)
            if name.startswith(f"reconstruction-round-{round_number}-")
        ]
        assert np.mean([m["psnr"]["mean"] for m in pooled]) > np.mean([m["null"]["psnr"]["mean"] for m in pooled])


@pytest.mark.parametrize(
    "recipe",
    [
        (
            *SMALL_CLIENTS[2:],
            "--algorithm",
            "scaffold",
            "--batch-size",
            "16",
            "--local-epochs",
            "3",
            "--momentum",
            "0.5",
        ),
        (
            *("--partition", "iid", "--num-clients", "20", "--client-fraction", "0.1", "--algorithm", "fedssyn"),
            *("--inner-algorithm", "fedsgd", "--batch-size", "4", "--synthetic-per-client", "3"),
        ),
    ],
    ids=["scaffold-momentum-cosine", "fedssyn-share"],
)
def test_the_recipe_read_from_the_run_gives_the_update_that_was_sent(recipe, tmp_path) -> None:
    """What the attack reads of a run (config.json, the round's starting checkpoint, SCAFFOLD's control variates,
    Fedssyn's dealt share) simulates, at the client's own records, exactly the update it sent, round after round."""
    from fedaudit.attacks.reconstruction.attack import ReconstructionTarget, _share, local_training, simulate_update
    from fedaudit.data import Partition
    from fedaudit.models import build_model, initial_params

    run_dir = tmp_path / "run"
    base = [a for a in FAST_ARGS if a not in ("--batch-size", "32")]
    extra = ("--generator-epochs", "1", "--generator-batch", "2") if "fedssyn" in recipe else ()
    done = invoke("train", *base, *recipe, *extra, "--rounds", "3", "--save-transmitted", "--out", run_dir)
    assert done.exit_code == 0, done.output
    run = RunDirectory(run_dir)
    config, manifest = run.read_run_config(), run.read_manifest()
    dataset, partition = load_dataset("digits"), Partition.from_arrays(run.read_membership())
    model = build_model(run.model_spec())
    model.eval()
    first = 2 if "fedssyn" in recipe else 1  # Fedssyn's first round sends generated records
    checked = 0
    for number in range(first, 4):
        for file in sorted((run_dir / "transmitted" / f"round-{number:04d}").iterdir()):
            client = int(file.stem.split("-")[1])
            start = (
                initial_params(run.model_spec(), config.seed) if number == 1 else run.checkpoints.load(number - 1)[0]
            )
            start = {name: start[name] for name, _ in model.named_parameters()}
            training = local_training(run, config, manifest, ReconstructionTarget(number, client), start)
            own = torch.from_numpy(partition.clients[client].copy())
            x, y = dataset.train_x[own], dataset.train_y[own]
            share = _share(run, number, client)
            if share:
                x, y = torch.cat([x, share["images"]]), torch.cat([y, share["labels"]])
            simulated = simulate_update(model, start, [x], y, training, training.plan(len(y), torch.Generator()))
            sent = load_tensors(file)
            assert max(float((simulated[n].detach() - sent[n]).abs().max()) for n in start) < 1e-6
            checked += 1
    assert checked == 2 * (4 - first)


def test_the_grid_images_are_the_records_and_reconstructions_the_table_names(attacked) -> None:
    dataset = load_dataset("digits")
    low, high = pixel_range(dataset.train_x)
    name = _results(attacked)[0]
    images = load_tensors(attacked / "attacks" / name / "images.safetensors")
    records = pd.read_csv(attacked / "attacks" / name / "records.csv")
    attack = records[records["kind"] == "update-inversion"].reset_index(drop=True)
    originals = to_pixels(dataset.train_x[torch.tensor(attack["record"].to_numpy())], low, high)
    assert np.allclose(images["original"].numpy(), originals, atol=1e-6)
    for i, row in attack.iterrows():
        expected = peak_signal_noise_ratio(originals[i], images["reconstructed"][i].double().numpy(), data_range=1.0)
        assert row["psnr"] == pytest.approx(expected, rel=1e-5)


def test_the_same_seed_rebuilds_the_same_records_and_one_client_can_be_named(attacked, tmp_path) -> None:
    copy = Path(shutil.copytree(attacked, tmp_path / "again"))
    name = _results(attacked)[-1]
    _, number, _, client = name.removeprefix("reconstruction-").split("-")
    result = invoke("attack", copy, "--method", "reconstruction", *QUICK, "--target", f"round:{number}:client:{client}")
    assert result.exit_code == 0, result.output
    assert "1 result(s) written" in result.stdout
    same = (copy / "attacks" / name / "records.csv").read_bytes()
    assert same == (attacked / "attacks" / name / "records.csv").read_bytes()
    assert RunDirectory(copy).seal.problems() == []


def test_the_report_shows_the_reconstruction_and_judges_the_policy_on_its_interval(attacked, tmp_path) -> None:
    out = tmp_path / "report"
    done = invoke("report", attacked, "--out", out, "--format", "html", "--format", "md")
    assert done.exit_code == 0, done.output
    markdown = (out / "report.md").read_text()
    assert "### Reconstruction from what crossed the wire" in markdown and "random update of the same norm" in markdown
    assert "LPIPS is not computed" in markdown
    assert "reconstruction of records from what crossed the wire" in markdown and "round 1 (2 client(s))" in markdown
    assert "the worst case for privacy first" in (out / "report.html").read_text()
    verdict = next(line for line in markdown.splitlines() if "the server could rebuild" in line)
    assert "records at 20 dB or more (mean PSNR" in verdict and "its null" in verdict
    summary = pd.read_csv(out / "summary.csv")
    rounds = json.loads((out / "summary.json").read_text())["runs"][0]["reconstructions"]
    final = rounds[-1]
    assert summary["reconstruction_psnr"][0] == pytest.approx(final["quality"]["psnr"]["mean"])
    low, high = final["quality"]["psnr"]["ci95"]
    worst_high = max(r["quality"]["psnr"]["ci95"][1] for r in rounds)
    best_low = min(r["quality"]["psnr"]["ci95"][0] for r in rounds)
    verdicts = {}
    for label, limit in (("pass", worst_high + 1.0), ("fail", 0.5), ("straddle", (low + high) / 2.0)):
        policy = tmp_path / f"{label}.yaml"
        policy.write_text(f"max_reconstruction_psnr: {limit}\n")
        result = invoke("report", attacked, "--out", tmp_path / label, "--format", "md", "--policy", policy)
        verdicts[label] = result.exit_code
    assert best_low > 0.5
    assert verdicts == {"pass": 0, "fail": 1, "straddle": 3}


def test_a_synthetic_set_is_judged_by_its_nearest_record_beside_held_out_records(tmp_path) -> None:
    run = tmp_path / "fedlap"
    small = ("--ipc", "2", "--max-loops", "1", "--real-batches", "1", "--server-epochs", "1", "--image-steps", "1")
    done = invoke(
        "train", *FAST_ARGS, "--algorithm", "fedlap", "--rounds", "1", *small, "--save-transmitted", "--out", run
    )
    assert done.exit_code == 0, done.output
    result = invoke("attack", run, "--method", "reconstruction", "--target", "round:1:client:0")
    assert result.exit_code == 0, result.output
    metrics = read_json(run / "attacks" / "reconstruction-round-1-client-0" / "metrics.json")
    assert metrics["signal"] == "synthetic-nearest" and metrics["null"]["kind"] == "held-out"
    records = pd.read_csv(run / "attacks" / "reconstruction-round-1-client-0" / "records.csv")
    dataset = load_dataset("digits")
    low, high = pixel_range(dataset.train_x)
    own = np.load(run / "membership.npz")["client_0"]
    reals = to_pixels(dataset.train_x[torch.from_numpy(own)], low, high)
    sent = load_tensors(run / "transmitted" / "round-0001" / "client-000.safetensors")
    synthetic = to_pixels(sent["images"], low, high)
    for _, row in records[records["kind"] == "synthetic-nearest"].iterrows():
        closest = max(peak_signal_noise_ratio(r, synthetic[row["image"]], data_range=1.0) for r in reals)
        assert row["psnr"] == pytest.approx(closest, rel=1e-6)
    held = records[records["kind"] == "held-out"]
    holdout = set(np.load(run / "membership.npz")["holdout"])
    assert set(held["image"]) <= holdout and (held["image_source"] == "holdout").all()
    assert sorted(held["label_guessed"]) == sorted(sent["labels"].tolist())  # held-out records of the same classes
    report = invoke("report", run, "--out", tmp_path / "report", "--format", "md")
    assert report.exit_code == 0, report.output
    markdown = (tmp_path / "report" / "report.md").read_text()
    assert "of the synthetic images sent in round 1" in markdown and "| synthetic set |" in markdown


def test_compare_attack_reconstruction_keeps_what_crossed_the_wire_and_plots_it_against_epsilon(tmp_path) -> None:
    plan = tmp_path / "study.yaml"
    plan.write_text(
        "attack:\n  methods: [threshold]\n  bootstrap: 40\n  reconstruction: {iterations: 30, restarts: 1}\n"
    )
    study = [
        "compare",
        "--study",
        plan,
        "--out",
        tmp_path / "study",
        "--algorithm",
        "fedsgd",
        "--budget",
        "none",
        "--budget",
        "eps:8",
        "--rounds",
        "1",
        "--partition",
        "iid",
        "--num-clients",
        "400",
        "--client-fraction",
        "0.005",
        "--attack",
        "reconstruction",
        "--format",
        "html",
        *FAST_ARGS,
        "--batch-size",
        "2",
    ]
    first = invoke(*study)
    assert first.exit_code == 0, first.output
    runs = sorted((tmp_path / "study" / "runs").iterdir())
    assert [r.name for r in runs] == ["fedsgd-eps8-seed0", "fedsgd-nodp-seed0"]
    for run in runs:
        assert read_json(run / "config.json")["save_transmitted"] is True
        assert len(_results(run)) == 2 and (run / "attacks" / "loss-threshold").is_dir()
    dp = read_json(runs[0] / "attacks" / _results(runs[0])[0] / "metrics.json")
    assert 0 < dp["accountant_epsilon"] <= 8.0 and dp["settings"]["iterations"] == 30
    recorded = read_json(tmp_path / "study" / "study.json")["study"]["attack"]
    assert recorded["methods"] == ["threshold", "reconstruction"] and recorded["reconstruction"]["restarts"] == 1
    assert "Reconstruction quality against epsilon" in (tmp_path / "study" / "report.html").read_text()
    again = invoke(*study)
    assert again.exit_code == 0, again.output
    assert again.output.count("attack results are up to date") == 2
