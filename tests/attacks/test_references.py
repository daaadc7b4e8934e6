"""Reference models: their records, the online balance, the cache in the run directory, and bad options."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import FAST_ARGS, assert_user_error, invoke

from fedaudit.attacks.membership.references import inclusion_matrix

ATTACK = ("--signal", "loss", "--method", "rmia", "--method", "lira", "--no-progress")


def attack(run: Path, *extra: str) -> dict:
    result = invoke("attack", run, *ATTACK, *extra)
    assert result.exit_code == 0, result.output
    return json.loads((run / "attacks" / "loss-rmia" / "metrics.json").read_text())


@pytest.fixture
def run(tmp_path: Path, plain_run: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(plain_run, copy)
    return copy


def test_online_references_hold_each_record_in_exactly_half_and_offline_ones_nest():
    online = inclusion_matrix(500, 8, online=True, seed=1)
    assert (online.sum(axis=0) == 4).all()
    offline = inclusion_matrix(500, 6, online=False, seed=1)
    assert (offline.sum(axis=1) == 250).all()
    assert np.array_equal(inclusion_matrix(500, 3, online=False, seed=1), offline[:3])
    assert not np.array_equal(inclusion_matrix(500, 3, online=False, seed=2), offline[:3])


def test_references_never_see_the_audited_records_offline_and_see_them_in_half_online(run):
    attack(run, "--references", "2")
    scores = __import__("pandas").read_csv(run / "attacks" / "loss-rmia" / "scores.csv")
    pool = np.load(run / "references" / "inclusion.npz")
    audited = set(zip(scores["source"], scores["record"]))
    assert not audited & set(zip(pool["source"].tolist(), pool["index"].tolist()))
    assert len(audited) + len(pool["index"]) == 1797  # every other record of digits is in the pool
    metrics = attack(run, "--references", "4", "--online")
    assert metrics["references"]["mode"] == "online" and metrics["references"]["a"] is None
    pool = np.load(run / "references" / "inclusion.npz")
    n = len(scores)
    head = list(zip(pool["source"][:n].tolist(), pool["index"][:n].tolist()))
    assert head == list(zip(scores["source"], scores["record"]))
    assert (pool["included"][:, :n].sum(axis=0) == 2).all()


def test_the_cache_is_reused_grown_and_invalidated(run):
    first = attack(run, "--references", "2")["references"]
    assert first["trained_now"] == 2 and first["count"] == 2 and first["a_tuned"] is True
    weights = (run / "references" / "ref-000.safetensors").read_bytes()
    assert attack(run, "--references", "2")["references"]["trained_now"] == 0
    assert attack(run, "--references", "1")["references"]["trained_now"] == 0
    assert attack(run, "--references", "3")["references"]["trained_now"] == 1  # the first two are kept
    assert (run / "references" / "ref-000.safetensors").read_bytes() == weights
    key = run / "references" / "references.json"
    stored = json.loads(key.read_text())
    key.write_text(json.dumps({**stored, "dataset_fingerprint": "0" * 64}))  # as if the data had changed
    assert attack(run, "--references", "2")["references"]["trained_now"] == 2
    assert invoke("train", "--resume", run, "--rounds", "4", "--no-progress").exit_code == 0
    assert attack(run, "--references", "2")["references"]["trained_now"] == 2  # the run changed: one more round
    assert not list((run / "references").glob(".work-*"))


def test_bad_reference_options_are_one_sentence(run, tmp_path):
    assert_user_error(invoke("attack", run, *ATTACK, "--references", "0"), mentions="--references")
    assert_user_error(invoke("attack", run, *ATTACK, "--references", "1000"), mentions="--references")
    assert_user_error(invoke("attack", run, *ATTACK, "--references", "3", "--online"), mentions="even")
    assert_user_error(invoke("attack", run, "--signal", "grad-norm", "--method", "rmia"), mentions="rmia")
    assert_user_error(invoke("attack", run, *ATTACK, "--target", "all"), mentions="final")
    small = tmp_path / "small"
    args = (*FAST_ARGS, "--dp", "--rounds", "1", "--batch-size", "128", "--num-clients", "5")
    assert invoke("train", *args, "--out", small).exit_code == 0
    line = assert_user_error(invoke("attack", small, *ATTACK, "--max-records", "700"), mentions="reference model")
    assert "population records" in line
    assert not (small / "attacks").exists() and not list((small / "references").glob(".work-*"))
    few = tmp_path / "few"  # 2 members a client: 10 population records cannot be split over 5 clients' classes
    assert invoke("train", *FAST_ARGS, "--rounds", "1", "--holdout-fraction", "0.999", "--out", few).exit_code == 0
    line = assert_user_error(invoke("attack", few, *ATTACK, "--references", "2", "--nonmembers", "holdout"))
    assert "split over the run's 5 clients under classes:2, some client would get no record" in line
    assert "holdout_fraction 0.0" not in line and "use fewer clients" not in line  # not the recipe's own advice


def test_online_rmia_without_population_records_is_one_sentence_before_any_reference_trains(tmp_path):
    """Two clients of an IID split and half the records held out: every member is audited and as many non-members,
    which fill the online pool to twice the target's size; no record is left for RMIA's population (it trained the
    references, then ended in a traceback)."""
    run = tmp_path / "run"
    args = (*FAST_ARGS, "--rounds", "1", "--num-clients", "2", "--partition", "iid", "--holdout-fraction", "0.5")
    assert invoke("train", *args, "--out", run).exit_code == 0
    line = assert_user_error(
        invoke("attack", run, "--signal", "loss", "--method", "rmia", "--references", "2", "--online"),
        mentions="population records",
    )
    assert "lower --max-records" in line
    assert not (run / "attacks").exists() and not (run / "references").exists()


def test_the_final_model_attacks_refuse_another_target_naming_only_those_given(run):
    line = assert_user_error(invoke("attack", run, "--method", "client", "--target", "round:1"), mentions="client")
    assert "--target final" in line and "rmia" not in line and "lira" not in line
    line = assert_user_error(invoke("attack", run, "--signal", "loss", "--method", "lira", "--target", "all"))
    assert line.count("lira") == 1 and "client" not in line and "rmia" not in line


def test_population_records_counts_those_compared():
    from fedaudit.attacks.membership.references import ReferenceSignals

    z_in = np.array([[True, True, False, True], [True, False, False, True]])  # z 0 and 3: in every reference
    common = dict(values={}, x_in=None, target_z=np.ones(4), refs_z=np.ones((2, 4)), z_in=z_in, a=0.3, a_tuned=False)
    offline = ReferenceSignals(**common, online=False, trained=0)
    online = ReferenceSignals(**common, online=True, trained=0)
    assert offline.details()["references"]["population_records"] == 2
    assert online.details()["references"]["population_records"] == 4


def test_a_result_is_current_only_for_the_references_it_used(run):
    from fedaudit.attacks.runner import AttackOptions, results_current

    attack(run, "--references", "2")
    options = AttackOptions(signals=("loss",), methods=("rmia", "lira"), references=2)
    assert results_current(run, options)
    assert not results_current(run, AttackOptions(signals=("loss",), methods=("rmia", "lira"), references=3))
    online = AttackOptions(signals=("loss",), methods=("rmia", "lira"), references=2, online=True)
    assert not results_current(run, online)
