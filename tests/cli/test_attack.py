"""``fedaudit attack`` end to end on digits: result files, leakage of an overfit run vs a DP run, rounds, bad input."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_user_error, invoke, rehash, tree_digest
from sklearn.metrics import roc_auc_score

from fedaudit.data import load_dataset
from fedaudit.rundir import RunDirectory

# A deliberately overfit run: 2 clients with about 21 records each (97% of digits held out), a wide MLP,
# 3 rounds of 100 local epochs. Digits generalises well, so leakage needs this few records per client.
OVERFIT = tuple(
    (
        "--num-clients 2 --partition iid --holdout-fraction 0.97 --width 256 --batch-size 8 --rounds 3 "
        "--local-epochs 100"
    ).split()
)
# DP-FedAvg with a small epsilon: sigma 5 on the fast configuration.
SMALL_EPSILON = ("--dp", "--noise-multiplier", "5", "--rounds", "3")
SCORE_COLUMNS = ["record", "source", "label", "client", "member", "split", "bound_role", "signal", "score"]


def read_json(path: Path):
    return json.loads(path.read_text())


def copy_run(run: Path, tmp_path: Path) -> Path:
    """Attacks write into the run directory; the session's cached runs stay untouched."""
    return Path(shutil.copytree(run, tmp_path / run.parent.name))


def attack_ok(cli, *args) -> str:
    result = cli("attack", *map(str, args), "--no-progress")
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def overfit_attacked(trained, tmp_path_factory) -> tuple[Path, str]:
    """The overfit run attacked with the defaults (loss and grad-norm, threshold and classifier)."""
    run = copy_run(trained(*OVERFIT), tmp_path_factory.mktemp("overfit"))
    result = invoke(
        "attack", str(run), "--no-progress", "--device", "cpu"
    )  # the signal checks below recompute on the CPU
    assert result.exit_code == 0, result.output
    return run, result.stdout


def test_defaults_write_one_directory_per_signal_and_method(overfit_attacked):
    run, _ = overfit_attacked
    names = sorted(p.name for p in (run / "attacks").iterdir())
    assert names == ["grad-norm-classifier", "grad-norm-threshold", "loss-classifier", "loss-threshold"]
    for name in names:
        files = sorted(p.name for p in (run / "attacks" / name).iterdir())
        assert files == ["metrics.json", "roc.csv", "scores.csv"]


def test_an_overfit_run_leaks(overfit_attacked):
    """Both signals' AUC intervals lie above 0.6; an epsilon bound above 0 (judged on 20 records a side, each rate
    at 97.5%) comes from the loss: the gradient norm's chosen test (TPR 14/20 at FPR 8/20) proves none at that size."""
    run, stdout = overfit_attacked
    bounds = []
    for signal in ("loss", "grad-norm"):
        threshold = read_json(run / "attacks" / f"{signal}-threshold" / "metrics.json")
        assert threshold["auc_ci95"][0] > 0.6, threshold["auc_ci95"]
        assert threshold["accountant_epsilon"] is None and threshold["epsilon_lower_bound_exceeds_accountant"] is None
        bounds.append(threshold["epsilon_lower_bound"])
        classifier = read_json(run / "attacks" / f"{signal}-classifier" / "metrics.json")
        assert classifier["auc"] > 0.6
    assert bounds[0] > 0
    header = stdout.splitlines()[1]
    assert "AUC" in header and "eps_lb" in header


def test_metrics_json_agrees_with_scores_and_roc(overfit_attacked):
    run, _ = overfit_attacked
    for method in ("threshold", "classifier"):
        folder = run / "attacks" / f"loss-{method}"
        metrics = read_json(folder / "metrics.json")
        scores = pd.read_csv(folder / "scores.csv")
        assert list(scores.columns) == SCORE_COLUMNS
        audit = scores[scores.split == "audit"]
        assert metrics["auc"] == pytest.approx(roc_auc_score(audit.member, audit.score))
        low, high = metrics["auc_ci95"]
        assert low <= metrics["auc"] <= high
        assert metrics["num_members"] == int(audit.member.sum()) == metrics["num_nonmembers"]
        assert set(scores.split) == ({"audit"} if method == "threshold" else {"audit", "attack-train"})
        roc = pd.read_csv(folder / "roc.csv")
        assert list(roc.columns) == ["fpr", "tpr", "threshold"]
        assert np.trapezoid(roc.tpr, roc.fpr) == pytest.approx(metrics["auc"])
        assert metrics["advantage"] == pytest.approx((roc.tpr - roc.fpr).max())
        at_1pct = metrics["tpr_at_fpr"]["0.01"]
        if len(audit) // 2 >= 100:
            assert at_1pct["tpr"] == pytest.approx(roc.tpr[roc.fpr <= 0.01].max())
        else:  # fewer than 100 non-members cannot resolve an FPR of 1%
            assert not at_1pct["estimable"] and at_1pct["tpr"] is None and at_1pct["nonmembers_needed"] == 100
        # The epsilon bound: one test chosen on the "choose" records, judged on the "judge" records alone.
        test = metrics["epsilon_lower_bound_test"]
        judged = scores[scores.bound_role == "judge"]
        assert (test["bound_members"], test["bound_nonmembers"]) == (judged.member.sum(), (judged.member == 0).sum())
        if test["threshold"] is not None:
            called = judged.score >= test["threshold"]
            assert test["true_positives"] == int((called & (judged.member == 1)).sum())
            assert test["false_positives"] == int((called & (judged.member == 0)).sum())
        assert metrics["balanced_accuracy"] == pytest.approx(0.5 + metrics["advantage"] / 2)
        assert {"signal", "method", "round", "seed", "delta", "per_client"} <= set(metrics)
        assert metrics["signal"] == "loss" and metrics["method"] == method and metrics["round"] == 3
        assert metrics["seed"] == 0 and metrics["delta"] == 1e-5
        assert sorted(metrics["per_client"]) == ["0", "1"]
        for k, entry in metrics["per_client"].items():
            assert entry["num_members"] == int((audit.client == int(k)).sum()) > 0
            assert 0 <= entry["auc_ci95"][0] <= entry["auc"] <= entry["auc_ci95"][1] <= 1


def test_loss_signal_is_the_model_loss_and_members_are_the_run_members(overfit_attacked):
    run, _ = overfit_attacked
    scores = pd.read_csv(run / "attacks" / "loss-threshold" / "scores.csv")
    membership = RunDirectory(run).read_membership()
    for k in (0, 1):
        rows = scores[scores.client == k]
        assert rows.member.eq(1).all() and np.isin(rows.record, membership[f"client_{k}"]).all()
    train_nonmembers = scores[(scores.member == 0) & (scores.source == "train")]
    assert np.isin(train_nonmembers.record, membership["holdout"]).all()
    model = RunDirectory(run).load_model()
    digits = load_dataset("digits")
    for source, x, y in (("train", digits.train_x, digits.train_y), ("test", digits.test_x, digits.test_y)):
        rows = scores[scores.source == source]
        index = torch.from_numpy(rows.record.to_numpy().copy())
        with torch.no_grad():
            loss = F.cross_entropy(model(x[index]).double(), y[index], reduction="none")
        np.testing.assert_allclose(rows.signal, loss.numpy(), rtol=1e-6, atol=1e-12)
        np.testing.assert_array_equal(rows.label, y[index].numpy())


def test_a_small_epsilon_dp_run_does_not_leak(trained, tmp_path, cli):
    run = copy_run(trained(*SMALL_EPSILON), tmp_path)
    attack_ok(cli, run, "--method", "threshold", "--method", "classifier", "--method", "population")
    ledger = read_json(run / "privacy.json")
    for folder in sorted((run / "attacks").iterdir()):
        metrics = read_json(folder / "metrics.json")
        low, high = metrics["auc_ci95"]
        assert low < 0.53 and high > 0.47, (folder.name, metrics["auc_ci95"])  # contains, or nearly contains, 0.5
        assert metrics["accountant_epsilon"] == pytest.approx(ledger["epsilon_per_round"][-1])
        assert metrics["epsilon_lower_bound"] < metrics["accountant_epsilon"]
        assert metrics["epsilon_lower_bound_exceeds_accountant"] is False
    population = read_json(run / "attacks" / "loss-population" / "metrics.json")["population"]
    assert [row["fpr_tolerance"] for row in population] == [0.001, 0.01, 0.05, 0.1, 0.2, 0.5]


def test_target_all_attacks_every_saved_round(plain_run, tmp_path, cli):
    run = copy_run(plain_run, tmp_path)
    stdout = attack_ok(cli, run, "--target", "all", "--signal", "loss", "--method", "threshold")
    assert sorted(p.name for p in (run / "attacks").iterdir()) == [f"loss-threshold-round-{m}" for m in (1, 2, 3)]
    aucs = [read_json(run / "attacks" / f"loss-threshold-round-{m}" / "metrics.json")["auc"] for m in (1, 2, 3)]
    rows = [line.split() for line in stdout.splitlines() if line.lstrip().startswith(str(run))]
    assert [int(r[1]) for r in rows] == [1, 2, 3]
    assert [float(r[6]) for r in rows] == pytest.approx(aucs, abs=5e-4)  # the table shows AUC per round
    # Rounds are different models: their scores differ, on the same evaluation records
    first, last = (pd.read_csv(run / "attacks" / f"loss-threshold-round-{m}" / "scores.csv") for m in (1, 3))
    assert first.record.equals(last.record) and not np.allclose(first.signal, last.signal)


def test_target_round_uses_that_checkpoint(plain_run, tmp_path, cli):
    run = copy_run(plain_run, tmp_path)
    attack_ok(cli, run, "--target", "round:3", "--signal", "confidence", "--method", "threshold")
    attack_ok(cli, run, "--signal", "confidence", "--method", "threshold")
    at_round = pd.read_csv(run / "attacks" / "confidence-threshold-round-3" / "scores.csv")
    final = pd.read_csv(run / "attacks" / "confidence-threshold" / "scores.csv")
    pd.testing.assert_frame_equal(at_round, final)  # the final model is the last round's checkpoint
    assert read_json(run / "attacks" / "confidence-threshold-round-3" / "metrics.json")["target"] == "round:3"


def test_per_layer_norms_and_seeded_reproducibility(plain_run, tmp_path, cli):
    run = copy_run(plain_run, tmp_path)
    args = (run, "--signal", "grad-norm", "--method", "classifier", "--per-layer", "--seed", "7")
    attack_ok(cli, *args)
    scores = pd.read_csv(run / "attacks" / "grad-norm-classifier" / "scores.csv")
    layers = [c for c in scores.columns if c.startswith("grad_norm:")]
    assert layers == ["grad_norm:net.1", "grad_norm:net.3"]  # MLP: hidden and output layer
    np.testing.assert_allclose(np.sqrt((scores[layers] ** 2).sum(axis=1)), scores.signal, rtol=1e-5)
    first = tree_digest(run / "attacks" / "grad-norm-classifier")
    attack_ok(cli, *args)
    again = tree_digest(run / "attacks" / "grad-norm-classifier")
    assert first["scores.csv"] == again["scores.csv"] and first["roc.csv"] == again["roc.csv"]
    attack_ok(cli, run, "--signal", "grad-norm", "--method", "classifier", "--seed", "8")
    other = pd.read_csv(run / "attacks" / "grad-norm-classifier" / "scores.csv")
    assert not other.record.equals(scores.record)


def test_nonmembers_option_selects_the_pool(plain_run, tmp_path, cli):
    run = copy_run(plain_run, tmp_path)
    attack_ok(cli, run, "--nonmembers", "test", "--signal", "loss", "--method", "threshold", "--max-records", "50")
    scores = pd.read_csv(run / "attacks" / "loss-threshold" / "scores.csv")
    assert set(scores[scores.member == 0].source) == {"test"}
    assert (scores.member == 1).sum() == (scores.member == 0).sum() == 50


def test_classes_partition_restricts_nonmembers_to_the_members_classes(trained, tmp_path, cli):
    # 2 clients x 2 classes of digits' 10: the holdout and the test split hold 6 classes no client trained on
    run = copy_run(trained("--num-clients", "2", "--rounds", "1"), tmp_path)
    attack_ok(cli, run, "--signal", "loss", "--method", "threshold")
    scores = pd.read_csv(run / "attacks" / "loss-threshold" / "scores.csv")
    member_classes = set(scores[scores.member == 1].label)
    assert len(member_classes) == 4
    assert set(scores[scores.member == 0].label) <= member_classes


# ---------------------------------------------------------------------------- bad input


def _remove(name):
    return lambda run: (run / name).unlink()


def _format_version(run):
    manifest = read_json(run / "manifest.json")
    manifest["format_version"] = 99
    (run / "manifest.json").write_text(json.dumps(manifest))


def _no_model_entry(run):
    manifest = read_json(run / "manifest.json")
    del manifest["model"]
    (run / "manifest.json").write_text(json.dumps(manifest))


def _drop_privacy(run):
    (run / "privacy.json").unlink()


def _model_from_another_round(run):
    shutil.copy(run / "checkpoints" / "round-0001.safetensors", run / "model.safetensors")


def _truncated_weights(run):
    data = (run / "model.safetensors").read_bytes()
    (run / "model.safetensors").write_bytes(data[: len(data) // 2])


def _float64_weights(run):
    from safetensors.torch import load_file, save_file

    from fedaudit.rundir import tensors_metadata

    path = run / "model.safetensors"
    metadata = tensors_metadata(path)
    save_file({k: t.double() for k, t in load_file(str(path)).items()}, str(path), metadata=metadata)


def _rehashed(damage):
    """The damage by a forger who also records the damaged files' hashes: the checks behind the hashes catch it."""
    return lambda run: (damage(run), rehash(run))


@pytest.mark.parametrize(
    ("damage", "mentions"),
    [
        (_remove("membership.npz"), "membership.npz"),
        (_remove("model.safetensors"), "model.safetensors"),
        (_remove("config.json"), "config.json"),
        (_format_version, "format"),
        (_model_from_another_round, "model.safetensors was changed"),
        (_truncated_weights, "model.safetensors was changed"),
        (_rehashed(_model_from_another_round), "resume"),
        (_rehashed(_truncated_weights), "corrupt"),
        (_rehashed(_float64_weights), "are float64"),
        (_no_model_entry, '"model" entry'),
    ],
    ids=[
        "no-membership",
        "no-model",
        "no-config",
        "other-format",
        "model-ahead-of-manifest",
        "truncated-weights",
        "model-ahead-of-manifest-rehashed",
        "truncated-weights-rehashed",
        "float64-weights-rehashed",
        "no-model-entry",
    ],
)
def test_damaged_runs_are_user_errors(plain_run, tmp_path, cli, damage, mentions):
    run = copy_run(plain_run, tmp_path)
    damage(run)
    before = tree_digest(run)
    assert_user_error(cli("attack", run, "--no-progress"), mentions=mentions)
    assert not (run / "attacks").exists()
    assert tree_digest(run) == before


def test_dp_run_without_its_ledger_is_a_user_error(dp_run, tmp_path, cli):
    run = copy_run(dp_run, tmp_path)
    _drop_privacy(run)
    assert_user_error(cli("attack", run, "--no-progress"), mentions="privacy.json")
    assert not (run / "attacks").exists()


@pytest.mark.parametrize(
    ("args", "mentions"),
    [
        (("--signal", "entropy"), "--signal"),
        (("--method", "likelihood"), "--method"),
        (("--target", "round:9"), "saved rounds: 1, 2, 3"),
        (("--target", "round:0"), "--target"),
        (("--target", "garbage"), "--target"),
        (("--target", "round:x"), "--target"),
        (("--nonmembers", "train"), "--nonmembers"),
        (("--max-records", "1"), "--max-records"),
        (("--seed", "-1"), "--seed"),
        (("--seed", str(2**32)), "--seed"),
        (("--bootstrap", "0"), "--bootstrap"),
    ],
)
def test_bad_options_are_user_errors(plain_run, tmp_path, cli, args, mentions):
    run = copy_run(plain_run, tmp_path)
    assert_user_error(cli("attack", run, *args, "--no-progress"), mentions=mentions)
    assert not (run / "attacks").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_user_error(plain_run, tmp_path, cli):
    run = copy_run(plain_run, tmp_path)
    assert_user_error(cli("attack", run, "--device", "cuda", "--no-progress"), mentions="cuda")
    assert not (run / "attacks").exists()


def test_not_a_run_directory(tmp_path, cli):
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    for target in (tmp_path / "empty", tmp_path / "afile", tmp_path / "missing"):
        assert_user_error(cli("attack", target, "--no-progress"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "empty"]
    assert not any((tmp_path / "empty").iterdir())


def test_one_bad_run_among_several_writes_nothing(plain_run, tmp_path, cli):
    good = copy_run(plain_run, tmp_path / "good")
    bad = copy_run(plain_run, tmp_path / "bad")
    (bad / "membership.npz").unlink()
    assert_user_error(cli("attack", good, bad, "--no-progress"), mentions=str(bad))
    assert not (good / "attacks").exists() and not (bad / "attacks").exists()


def test_several_runs_in_one_table(plain_run, dp_run, tmp_path, cli):
    plain, dp = copy_run(plain_run, tmp_path / "a"), copy_run(dp_run, tmp_path / "b")
    stdout = attack_ok(cli, plain, dp, "--signal", "loss", "--method", "threshold", "--bootstrap", "100")
    assert re.search(rf"^\s*{re.escape(str(plain))}\s+3\s+loss\s+threshold", stdout, re.M)
    assert re.search(rf"^\s*{re.escape(str(dp))}\s+3\s+loss\s+threshold", stdout, re.M)
    dp_row = next(line for line in stdout.splitlines() if line.lstrip().startswith(str(dp)))
    plain_row = next(line for line in stdout.splitlines() if line.lstrip().startswith(str(plain)))
    assert plain_row.rstrip().endswith("no DP")  # no accountant epsilon without DP
    eps = read_json(dp / "privacy.json")["epsilon_per_round"][-1]
    assert dp_row.rstrip().endswith(f"{eps:.3f}")


def test_a_model_with_nan_weights_is_refused_in_one_sentence(plain_run, tmp_path, cli):
    import shutil

    import torch
    from helpers import assert_user_error
    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    path = run / "model.safetensors"
    from fedaudit.rundir import tensors_metadata

    metadata = tensors_metadata(path)
    weights = {name: torch.full_like(t, float("nan")) for name, t in load_file(str(path)).items()}
    save_file(weights, str(path), metadata=metadata)
    assert_user_error(cli("attack", run, "--no-progress"), mentions="model.safetensors was changed")
    rehash(run)
    assert_user_error(cli("attack", run, "--no-progress"), mentions="non-finite")
    assert not (run / "attacks").exists()


def test_a_client_with_too_few_audited_members_gets_no_interval_and_says_why():
    """A federation of many small clients: a client with fewer than MIN_CLIENT_MEMBERS audited members is reported
    with its counts and the reason, not with a bootstrap interval over a handful of repeated records."""
    from fedaudit.attacks.membership.evaluation import EvaluationSet
    from fedaudit.attacks.runner import MIN_CLIENT_MEMBERS, _per_client

    rng = np.random.default_rng(0)
    clients = np.array([0] * 20 + [1] * (MIN_CLIENT_MEMBERS - 1) + [-1] * 40)
    member = (clients >= 0).astype(np.int8)
    ev = EvaluationSet(
        source=np.full(len(clients), "train"),
        index=np.arange(len(clients)),
        label=np.zeros(len(clients), dtype=np.int64),
        member=member,
        client=clients,
        attack_train=np.zeros(len(clients), dtype=bool),
        client_classes={0: np.array([0]), 1: np.array([0])},
    )
    table = _per_client(ev, np.ones(len(clients), dtype=bool), rng.normal(size=len(clients)), rng=rng, resamples=200)
    assert table["0"]["auc_ci95"] is not None and "not_resolved" not in table["0"]
    assert table["1"]["auc"] is None and table["1"]["auc_ci95"] is None
    assert table["1"]["num_members"] == MIN_CLIENT_MEMBERS - 1 and "fewer than" in table["1"]["not_resolved"]


def test_an_audit_of_a_few_records_leaves_clients_without_non_members_unscored(plain_run, tmp_path):
    """With 5 records audited, some clients' classes have no audited non-member: the per-client table says so for
    them (a bootstrap over no non-member divided by zero and the attack ended in a traceback)."""
    run = tmp_path / "run"
    shutil.copytree(plain_run, run)
    result = invoke("attack", run, "--max-records", "5", "--method", "threshold", "--signal", "loss", "--no-progress")
    assert result.exit_code == 0, result.output
    (metrics,) = [json.loads(p.read_text()) for p in (run / "attacks").glob("*/metrics.json")]
    clients = metrics["per_client"].values()
    unscored = [c for c in clients if c["num_nonmembers"] == 0]
    assert unscored and all(c["auc_ci95"] is None and "no audited non-member" in c["not_resolved"] for c in unscored)
