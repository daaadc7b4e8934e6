"""A federation whose sites keep their records (--dataset sites): each site reads, splits, standardises and hashes its
own file; the local engine reads every site as that site would; a client trains on its own site's members only; the
model is evaluated site by site; the audit scores each site's records where they are."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_user_error, invoke
from sklearn.datasets import load_digits

from fedaudit.algorithms.base import evaluation_counts
from fedaudit.config import DataConfig, RunConfig
from fedaudit.data.sites import SiteReport, federation, load_sites, locate, read_site, recorded_hashes
from fedaudit.instruments.record_signals import compute_signals
from fedaudit.models import build_model, initial_params
from fedaudit.preparation import client_data, prepare
from fedaudit.training import evaluate

SMALL = "--model mlp --width 16 --depth 1 --batch-size 32 --local-epochs 1 --device cpu --no-progress".split()


@pytest.fixture(scope="module")
def site_files(tmp_path_factory) -> list[Path]:
    """Digits in three files, one per site, with different classes (non-IID); the third has no test split."""
    digits = load_digits()
    x, y = digits.images.astype(np.float32)[:, None], digits.target
    folder = tmp_path_factory.mktemp("sites")
    files = []
    for k, classes in enumerate(((0, 1, 2), (3, 4, 5), (6, 7, 8, 9))):
        index = np.flatnonzero(np.isin(y, classes))
        cut = int(0.8 * len(index))
        path = folder / f"site{k}.npz"
        if k < 2:
            train, test = index[:cut], index[cut:]
            np.savez(path, x=x[train], y=y[train], x_test=x[test], y_test=y[test])
        else:
            np.savez(path, x=x[index], y=y[index])
        files.append(path)
    return files


def site_args(files: list[Path]) -> list[str]:
    return ["--dataset", "sites", "--num-clients", str(len(files)), *(f"--site-data=npz:{f}" for f in files)]


def test_a_site_splits_its_records_from_the_seed_and_its_client_id_and_hashes_each_one(site_files):
    raw = np.load(site_files[0])
    site = read_site(f"npz:{site_files[0]}", 0, seed=5, holdout_fraction=0.2)
    n = len(raw["y"])
    assert len(site.heldout) == int(0.2 * n) and len(site.members) == n - int(0.2 * n)
    assert np.array_equal(np.sort(np.concatenate([site.members, site.heldout])), np.arange(n))
    # the slow loop: HMAC-SHA256 of the raw values (float32) and the label (int64) under the site's key, the SHA-256
    # of a domain tag and the whole file's arrays
    key = hashlib.sha256(
        b"fedaudit site record key\0"
        + raw["x"].astype(np.float32).tobytes()
        + raw["y"].astype(np.int64).tobytes()
        + raw["x_test"].astype(np.float32).tobytes()
        + raw["y_test"].astype(np.int64).tobytes()
    ).digest()
    for i in (0, 7, n - 1):
        record = raw["x"][i].astype(np.float32).tobytes() + np.int64(raw["y"][i]).tobytes()
        assert bytes(site.hashes[i]) == hmac.new(key, record, hashlib.sha256).digest()
        assert bytes(site.hashes[i]) != hashlib.sha256(record).digest()  # a plain hash would reveal membership
    again = read_site(f"npz:{site_files[0]}", 0, seed=5, holdout_fraction=0.2)
    assert np.array_equal(again.members, site.members)
    other = read_site(f"npz:{site_files[0]}", 1, seed=5, holdout_fraction=0.2)  # another client id: another draw
    assert not np.array_equal(other.members, site.members)
    assert site.train_y.tolist() == raw["y"].tolist()  # the file's class numbers, not renumbered
    assert abs(float(site.train_x.mean())) < 1e-4  # standardised with the site's own statistics


def test_the_servers_view_from_the_sites_reports_is_the_local_view_without_the_records(site_files):
    specs = tuple(f"npz:{f}" for f in site_files)
    dataset, partition, reports = load_sites(specs, seed=0, holdout_fraction=0.1)
    summaries = [SiteReport.from_summary(json.loads(json.dumps(r.summary()))) for r in reports]
    shell, rebuilt = federation(summaries)
    assert len(shell.train_y) == 0 and shell.fingerprint == dataset.fingerprint
    assert shell.num_classes == dataset.num_classes == 10
    for a, b in zip(partition.clients, rebuilt.clients):
        assert np.array_equal(a, b)
    assert np.array_equal(partition.holdout, rebuilt.holdout)
    counts = np.array([r.records for r in reports])
    site, position = locate(partition.holdout, counts)
    for k, report in enumerate(reports):
        assert np.array_equal(np.sort(position[site == k]), report.heldout)
    membership = {**partition.to_arrays(), "site_records": counts}
    for report in reports:
        membership[f"member_hashes_{report.client}"] = report.member_hashes
        membership[f"heldout_hashes_{report.client}"] = report.heldout_hashes
    assert np.array_equal(recorded_hashes(membership, 1, reports[1].heldout[::-1]), reports[1].heldout_hashes[::-1])
    assert recorded_hashes(membership, 1, np.array([reports[1].records])) is None


def test_each_client_trains_on_its_own_sites_members_and_the_model_is_evaluated_site_by_site(site_files):
    config = RunConfig(data=DataConfig(dataset="sites", num_clients=3, sites=tuple(f"npz:{f}" for f in site_files)))
    setup = prepare(config.with_overrides({"model.arch": "mlp", "model.width": 16, "model.depth": 1}))
    for k, path in enumerate(site_files):
        site = read_site(f"npz:{path}", k, seed=0, holdout_fraction=0.1)
        data = client_data(setup, k)
        assert torch.equal(data.x, site.train_x[torch.from_numpy(site.members)])
        assert torch.equal(data.y, site.train_y[torch.from_numpy(site.members)])
    model = build_model(setup.spec)
    params = initial_params(setup.spec, 0)
    counts = []
    start = 0
    for size in setup.dataset.test_sites:
        part = slice(start, start + size)
        counts.append(evaluation_counts(model, params, setup.dataset.test_x[part], setup.dataset.test_y[part]))
        start += size
    accuracy, loss = evaluate(model, params, setup.dataset.test_x, setup.dataset.test_y, sites=setup.dataset.test_sites)
    assert accuracy == sum(c for c, _, _ in counts) / sum(n for _, _, n in counts)
    assert loss == sum(x for _, x, _ in counts) / sum(n for _, _, n in counts)


def test_a_sites_run_records_hashes_and_is_audited_site_by_site(site_files, tmp_path):
    run = tmp_path / "run"
    result = invoke("train", *SMALL, *site_args(site_files), "--rounds", "2", "--out", run)
    assert result.exit_code == 0, result.output
    membership = dict(np.load(run / "membership.npz"))
    for k, path in enumerate(site_files):
        site = read_site(f"npz:{path}", k, seed=0, holdout_fraction=0.1)
        assert np.array_equal(membership[f"member_hashes_{k}"], site.hashes[site.members])
        assert np.array_equal(membership[f"heldout_hashes_{k}"], site.hashes[site.heldout])
    config = json.loads((run / "config.json").read_text())
    assert config["data"]["sites"] == [f"npz:{f}" for f in site_files]
    assert invoke("attack", run, "--signal", "loss", "--method", "threshold", "--no-progress").exit_code == 0
    scores = np.genfromtxt(run / "attacks" / "loss-threshold" / "scores.csv", delimiter=",", names=True, dtype=None)
    assert set(np.asarray(scores["label"]).tolist()) == {-1}  # no label leaves a site
    # the signals are each site's, computed on its own records in the evaluation set's order
    from fedaudit.attacks.runner import AttackOptions, prepare_run
    from fedaudit.rundir import RunDirectory

    prepared = prepare_run(run, AttackOptions(signals=("loss",), methods=("threshold",)))
    assert set(prepared.evaluation.source.tolist()) == {"train"}  # members and the sites' held-out records
    model = RunDirectory(run).load_model()
    index = torch.from_numpy(prepared.evaluation.index)
    direct = compute_signals(model, prepared.dataset.train_x[index], prepared.dataset.train_y[index], ["loss"])
    assert np.allclose(direct.values["loss"], -np.asarray(scores["score"], dtype=float), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "extra, mentions",
    [
        (["--site-data", "npz:a.npz"], "--site-data needs --dataset sites"),
        (["--dataset", "sites", "--num-clients", "3", "--site-data", "npz:a.npz"], "one --site-data per client"),
        (["--dataset", "sites", "--num-clients", "2"], "are at its sites, not here"),
        (["--dataset", "sites", "--num-clients", "1", "--site-data", "npz:a.npz", "--partition", "iid"], "--partition"),
        (["--dataset", "sites", "--num-clients", "1", "--site-data", "txt:a.npz"], "npz:PATH, csv:PATH or folder:DIR"),
        (["--dataset", "sites", "--num-clients", "1", "--site-data", "npz:missing.npz"], "does not exist"),
        (["--dataset", "sites", "--num-clients", "1", "--site-data", "npz:a.npz", "--engine", "flower"], "simulation"),
        (
            [
                *("--dataset", "sites", "--num-clients", "1", "--site-data", "npz:a.npz"),
                *("--dp", "--canaries", "10", "--canary-kind", "input"),
            ],
            "use gradient canaries",
        ),
    ],
)
def test_bad_site_options_are_one_sentence_and_write_nothing(tmp_path, monkeypatch, extra, mentions):
    monkeypatch.chdir(tmp_path)
    digits = load_digits()
    np.savez(tmp_path / "a.npz", x=digits.images[:200].astype(np.float32), y=digits.target[:200])
    assert_user_error(invoke("train", *SMALL, *extra, "--out", tmp_path / "run"), mentions=mentions)
    assert not (tmp_path / "run").exists()


def test_bad_site_files_are_one_sentence(tmp_path):
    digits = load_digits()
    x, y = digits.images[:200].astype(np.float32), digits.target[:200]
    np.savez(tmp_path / "negative.npz", x=x, y=y - 5)
    np.savez(tmp_path / "wide.npz", x=np.zeros((200, 1, 8, 9), dtype=np.float32), y=y)
    np.savez(tmp_path / "good.npz", x=x, y=y)
    for files, mentions in (
        (["negative.npz", "good.npz"], "negative labels"),
        (["good.npz", "wide.npz"], "different shapes"),
    ):
        args = ["--dataset", "sites", "--num-clients", "2", *(f"--site-data=npz:{tmp_path / f}" for f in files)]
        assert_user_error(invoke("train", *SMALL, *args, "--out", tmp_path / "run"), mentions=mentions)
        assert not (tmp_path / "run").exists()


def test_an_attack_that_would_reach_the_sites_needs_its_connection_complete(tmp_path, site_files):
    assert_user_error(invoke("attack", tmp_path, "--superlink", "127.0.0.1:9"), mentions="--root-certificates")
    assert_user_error(invoke("attack", tmp_path, "--insecure"), mentions="need --superlink")


def test_the_audit_of_sites_draws_as_many_held_out_records_as_members_from_every_site(site_files):
    """Members and non-members are the same mixture of sites, and a client is compared with its own site's held-out
    records: with sites of different classes, anything else would measure the site, not membership."""
    from fedaudit.attacks.membership.site_audit import evaluation_set
    from fedaudit.attacks.runner import _per_client

    specs = tuple(f"npz:{f}" for f in site_files)
    _, partition, reports = load_sites(specs, seed=0, holdout_fraction=0.1)
    counts = np.array([r.records for r in reports])
    for cap in (10_000, 60):
        ev = evaluation_set(partition, counts, nonmembers="both", max_records=cap, seed=3, exclude=None)
        site, _ = locate(ev.index, counts)
        assert np.array_equal(site, ev.group) and len(ev) // 2 <= cap
        for k in range(3):
            members = (ev.member == 1) & (site == k)
            assert members.sum() == ((ev.member == 0) & (site == k)).sum() > 0
            assert set(ev.client[members].tolist()) == {k}
            assert np.isin(ev.index[members], partition.clients[k]).all()
        assert np.isin(ev.index[ev.member == 0], partition.holdout).all()
    rng = np.random.default_rng(0)
    table = _per_client(ev, np.ones(len(ev), dtype=bool), rng.normal(size=len(ev)), rng=rng, resamples=50)
    for k in range(3):
        assert table[str(k)]["num_nonmembers"] == int(((ev.member == 0) & (ev.group == k)).sum())
    with pytest.raises(Exception, match="--nonmembers holdout"):
        evaluation_set(partition, counts, nonmembers="test", max_records=100, seed=0, exclude=None)
