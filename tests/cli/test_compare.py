"""``fedaudit compare``: a study's plan, its runs, attacks and comparison report, resuming, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from helpers import assert_user_error, fashion_mnist, interrupt_in_round, invoke, same_secrets, tree_digest

from fedaudit.config import RunConfig
from fedaudit.errors import UserError
from fedaudit.study import Budget, Study, StudyError, _duration, load_study, plan

# Small, fast settings: the MLP of the other CLI tests and a FedLAP with T = 1 * 2 * 2 = 4 queries per round.
BASE = {
    "data": {"dataset": "digits"},
    "model": {"arch": "mlp", "width": 16, "depth": 1},
    "federated": {"rounds": 2, "batch_size": 32},
    "fedlap": {
        "ipc": 2,
        "trajectories": 1,
        "max_loops": 2,
        "real_batches": 2,
        "image_steps": 2,
        "model_epochs": 1,
        "server_epochs": 5,
    },
    "device": "cpu",
}
STUDY = {
    "algorithms": ["fedavg", "fedlap"],
    "budgets": ["epsilon:20", "none"],
    "seeds": [0, 1],
    "equal_data_access": True,
    "base": BASE,
    "attack": {"signals": ["loss"], "methods": ["threshold"], "max_records": 200, "bootstrap": 50},
    "report": {"formats": ["html", "md"]},
}
NAMES = [
    f"{algorithm}-{budget}-seed{seed}"
    for seed in (0, 1)
    for budget in ("eps20", "nodp")
    for algorithm in ("fedavg", "fedlap")
]


def read_json(path: Path):
    return json.loads(path.read_text())


def write_study(folder: Path, **changes) -> Path:
    path = folder / "study.yaml"
    path.write_text(yaml.safe_dump({**STUDY, **changes}))
    return path


def compare(*args) -> object:
    return invoke("compare", *map(str, args), "--no-progress")


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[Path, Path, str]:
    """The study file, its directory after one complete `fedaudit compare`, and what the command printed."""
    folder = tmp_path_factory.mktemp("study")
    with same_secrets():  # a test with fixed_secrets trains its runs again
        result = compare("--study", write_study(folder), "--out", folder / "out")
    assert result.exit_code == 0, result.output
    return folder / "study.yaml", folder / "out", result.stdout


# ---------------------------------------------------------------------------- the plan


def test_budgets_parse_and_name_runs():
    assert Budget.parse("epsilon:8") == Budget("epsilon", 8.0) == Budget.parse("eps:8")
    assert Budget.parse(" sigma:0.5 ") == Budget("sigma", 0.5) and Budget.parse("none") == Budget("none")
    assert [b.slug for b in (Budget("epsilon", 2.5), Budget("sigma", 1.0), Budget("none"))] == [
        "eps2.5",
        "sigma1",
        "nodp",
    ]
    for bad in ("epsilon", "epsilon:-1", "sigma:nan", "rho:1", "epsilon:inf"):
        with pytest.raises(StudyError):
            Budget.parse(bad)


def test_plan_crosses_algorithms_budgets_and_seeds_at_equal_data_access(tmp_path):
    runs = plan(load_study(write_study(tmp_path)))
    assert [r.name for r in runs] == NAMES
    for run in runs:
        config = run.config.resolved()
        assert config.seed == run.seed and config.federated.algorithm == run.algorithm
        assert config.privacy.dp == (run.budget.kind != "none")
        assert config.privacy.target_epsilon == run.budget.value
        assert config.model.arch == "mlp" and config.federated.rounds == 2
        # FedLAP's worst case here is R_i * L * R_b = 1 * 2 * 2 queries; FedAvg gets as many local steps
        assert config.federated.local_steps == (4 if run.algorithm == "fedavg" else None)


def test_systems_without_record_level_dp_are_planned_beside_the_budgets(tmp_path):
    """FedGM (label DP) and FedDM are trained once per seed without record-level DP; Fedssyn takes every budget; the
    base's FedGM and Fedssyn sections reach their own runs only."""
    base = {**BASE, "fedgm": {"label_epsilon": 2.0}, "fedssyn": {"generator_epochs": 3}}
    study = load_study(
        write_study(
            tmp_path,
            algorithms=["fedavg", "fedssyn", "fedgm", "feddm"],
            budgets=["epsilon:8", "epsilon:20"],
            seeds=[0],
            equal_data_access=False,
            base=base,
        )
    )
    runs = plan(study)
    assert [r.name for r in runs] == [
        "fedavg-eps8-seed0",
        "fedssyn-eps8-seed0",
        "fedgm-nodp-seed0",
        "feddm-nodp-seed0",
        "fedavg-eps20-seed0",
        "fedssyn-eps20-seed0",
    ]
    for run in runs:
        config = run.config.resolved()
        assert config.privacy.dp == (run.algorithm in ("fedavg", "fedssyn"))
        assert config.fedgm.label_epsilon == (2.0 if run.algorithm == "fedgm" else None)
        assert config.fedssyn.generator_epochs == (3 if run.algorithm == "fedssyn" else 30)


@pytest.mark.parametrize(
    "changes, mentions",
    [
        ({"algorithms": ["fedavg"]}, "must include fedlap"),
        ({"algorithms": ["fedlap", "fedsgd"]}, "fedsgd"),
        ({"algorithms": ["fedfoo"]}, "fedfoo"),
        ({"budgets": ["epsilon:0"]}, "epsilon:0"),
        ({"seeds": [-1]}, "seeds"),
        ({"base": {**BASE, "privacy": {"dp": True}}}, "budgets set them"),
        ({"report": {"formats": ["docx"]}}, "docx"),
        ({"attack": {"signals": ["loss"], "methods": ["magic"]}}, "magic"),
        ({"budgets": ["sigma:1_0"]}, "sigma:1_0"),  # float() reads 1_0 as 10
        ({"base": {**BASE, "seed": 5}}, "seeds: [5]"),
        ({"max_update_norm": -1}, "max_update_norm"),
        ({"attack": {**STUDY["attack"], "reconstruction": {"iterations": -5}}}, "--iterations"),
        ({"attack": {"signals": ["loss"], "methods": ["threshold", "canary"]}}, "no run of this study has any"),
        ({"base": {**BASE, "federated": {**BASE["federated"], "local_epochs": 100_000}}}, "--local-epochs"),
        ({"base": {**BASE, "model": {"arch": "convnet", "width": 100_000}}}, "--width"),
    ],
)
def test_a_study_that_cannot_work_is_refused_before_anything_runs(tmp_path, changes, mentions):
    study = write_study(tmp_path, **changes)
    out = tmp_path / "out"
    assert_user_error(compare("--study", study, "--out", out), mentions=mentions)
    assert not out.exists()


def test_study_file_errors_are_one_sentence(tmp_path):
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("algorithms: [fedavg]\nbudget: [none]\n")
    assert_user_error(compare("--study", unknown, "--out", tmp_path / "o"), mentions="'budget'")
    broken = tmp_path / "broken.yaml"
    broken.write_text("algorithms: [fedavg\n")
    assert_user_error(compare("--study", broken, "--out", tmp_path / "o"), mentions="not valid YAML")
    assert_user_error(compare("--study", tmp_path / "absent.yaml", "--out", tmp_path / "o"), mentions="absent.yaml")
    bad_config = write_study(tmp_path, base={"federated": {"rounds": 0}})
    assert_user_error(compare("--study", bad_config, "--out", tmp_path / "o"), mentions="--rounds")
    assert not (tmp_path / "o").exists()


def test_command_line_options_override_the_study_file(tmp_path):
    from fedaudit.study import study_from_options

    study = study_from_options(
        str(write_study(tmp_path)),
        algorithms=("fedlap",),
        budgets=("sigma:2",),
        seeds=(5,),
        equal_data_access=False,
        config_file=None,
        base_overrides={"federated.rounds": 3},
        attack_overrides={"signals": (), "methods": ("population",), "target": None},
        formats=(),
        policy=None,
    )
    assert (study.algorithms, study.budgets, study.seeds) == (("fedlap",), (Budget("sigma", 2.0),), (5,))
    assert not study.equal_data_access and study.base.federated.rounds == 3 and study.base.model.arch == "mlp"
    assert study.attack.signals == ("loss",) and study.attack.methods == ("population",)
    assert study.formats == ("html", "md") and Study().algorithms == ("fedavg", "fedprox", "fedlap")


# ---------------------------------------------------------------------------- a study end to end


def test_every_run_is_trained_and_attacked(study):
    _, out, stdout = study
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(NAMES)
    recorded = read_json(out / "study.json")
    assert recorded["format"] == "fedaudit-study" and recorded["runs"] == NAMES
    for name in NAMES:
        run = out / "runs" / name
        assert read_json(run / "manifest.json")["status"] == "complete"
        metrics = read_json(run / "attacks" / "loss-threshold" / "metrics.json")
        assert metrics["round"] == 2 and metrics["num_members"] == 200
    assert stdout.count("trained 2 rounds") == len(NAMES)
    timing, planned, estimate = stdout.splitlines()[:3]  # what it is doing before the plan, while it times
    assert timing.startswith("timing a first round of each algorithm")
    assert planned == "plan: 8 runs, 8 to train or resume (16 rounds in all), 0 kept as they are"
    assert "estimated time here: about" in estimate and "FedLAP-DP" in estimate
    assert f"Wrote {out / 'report.html'}" in stdout and (out / "report.md").is_file()


def test_equal_data_access_and_the_budget_give_equal_epsilon(study):
    _, out, _ = study
    for seed in (0, 1):
        avg, lap = (read_json(out / "runs" / f"{a}-eps20-seed{seed}" / "privacy.json") for a in ("fedavg", "fedlap"))
        assert avg["entries"] == lap["entries"]  # the same (sigma, q, steps): the same DP queries per round
        assert avg["epsilon_per_round"] == lap["epsilon_per_round"]
        assert 19 < avg["epsilon_per_round"][-1] <= 20  # the smallest sigma that meets the target
        config = RunConfig.from_dict(read_json(out / "runs" / f"fedavg-eps20-seed{seed}" / "config.json"))
        assert config.federated.local_steps == 4 and config.privacy.calibrated
        assert not (out / "runs" / f"fedavg-nodp-seed{seed}" / "privacy.json").exists()


def test_report_gives_mean_and_spread_over_seeds(study):
    _, out, _ = study
    groups = pd.read_csv(out / "groups.csv")
    assert list(groups["group"]) == ["DP-FedAvg, epsilon 20", "FedLAP-DP, epsilon 20", "FedAvg, no DP", "FedLAP, no DP"]
    assert (groups["runs"] == 2).all() and (groups["seeds"] == "0 1").all()
    for row in groups.itertuples():
        algorithm, budget = row.group.split(", ")
        slug = "eps20" if budget == "epsilon 20" else "nodp"
        key = "fedlap" if "FedLAP" in algorithm else "fedavg"
        accuracy = [
            pd.read_csv(out / "runs" / f"{key}-{slug}-seed{s}" / "metrics.csv")["test_accuracy"].iloc[-1]
            for s in (0, 1)
        ]
        aucs = [
            read_json(out / "runs" / f"{key}-{slug}-seed{s}" / "attacks" / "loss-threshold" / "metrics.json")["auc"]
            for s in (0, 1)
        ]
        assert row.final_accuracy_mean == pytest.approx(np.mean(accuracy))
        assert row.final_accuracy_std == pytest.approx(np.std(accuracy, ddof=1))
        assert row.attack_auc_mean == pytest.approx(np.mean(aucs)) and row.attack_auc_n == 2
    summary = read_json(out / "summary.json")
    assert [g["group"] for g in summary["groups"]] == list(groups["group"])
    assert [r["group"] for r in summary["runs"]][:4] == [
        "DP-FedAvg, epsilon 20",
        "FedLAP-DP, epsilon 20",
        "FedAvg, no DP",
        "FedLAP, no DP",
    ]
    html = (out / "report.html").read_text()
    assert "<h3>Over seeds</h3>" in html and "Privacy-utility trade-off" in html
    assert "| FedLAP-DP | epsilon 20 | 2 | 0 1 |" in (out / "report.md").read_text()


def test_running_the_study_again_recomputes_nothing(study, tmp_path):
    study_file, original, _ = study
    out = Path(shutil.copytree(original, tmp_path / "out"))
    before = tree_digest(out / "runs")
    result = compare("--study", study_file, "--out", out)
    assert result.exit_code == 0, result.output
    assert tree_digest(out / "runs") == before
    assert result.stdout.count("), kept") == len(NAMES) and result.stdout.count("up to date") == len(NAMES)
    assert result.stdout.startswith("plan: 8 runs, 0 to train or resume (0 rounds in all), 8 kept as they are\n")


def test_an_interrupted_run_is_resumed_exactly_and_new_runs_are_added(study, tmp_path, monkeypatch, fixed_secrets):
    study_file, original, _ = study
    out = Path(shutil.copytree(original, tmp_path / "out"))
    shutil.rmtree(out / "runs" / "fedlap-eps20-seed1")
    # in round 2 of the only run to train (the third evaluation: the plan's timed first round is the first; the kept
    # runs do not evaluate again)
    interrupt_in_round(monkeypatch, 3)
    result = compare("--study", study_file, "--out", out)
    assert result.exit_code == 1  # Ctrl-C
    assert read_json(out / "runs" / "fedlap-eps20-seed1" / "manifest.json")["status"] == "interrupted"
    monkeypatch.undo()

    result = compare("--study", study_file, "--out", out, "--seed", "0", "--seed", "1", "--seed", "2")
    assert result.exit_code == 0, result.output
    assert "fedlap-eps20-seed1: resumed from round 1" in result.stdout
    assert result.stdout.count("trained 2 rounds") == 4  # only the new seed's runs
    resumed, reference = out / "runs" / "fedlap-eps20-seed1", original / "runs" / "fedlap-eps20-seed1"
    assert (resumed / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert read_json(resumed / "privacy.json") == read_json(reference / "privacy.json")
    assert len(pd.read_csv(out / "summary.csv")) == 12 and (pd.read_csv(out / "groups.csv")["runs"] == 3).all()


def test_a_run_that_differs_from_the_plan_is_an_error_unless_overwritten(study, tmp_path):
    study_file, original, _ = study
    out = Path(shutil.copytree(original, tmp_path / "out"))
    config = read_json(out / "runs" / "fedavg-nodp-seed0" / "config.json")
    config["federated"]["momentum"] = 0.5
    (out / "runs" / "fedavg-nodp-seed0" / "config.json").write_text(json.dumps(config))
    recorded = (out / "study.json").read_bytes()
    result = compare("--study", study_file, "--out", out, "--seed", "2", "--seed", "0")
    assert_user_error(result, mentions="--overwrite")
    # found before anything ran: the new seed's runs were not trained and study.json is as it was
    assert not list((out / "runs").glob("*-seed2")) and (out / "study.json").read_bytes() == recorded
    result = compare("--study", study_file, "--out", out, "--overwrite")
    assert result.exit_code == 0, result.output
    assert "fedavg-nodp-seed0: trained 2 rounds" in result.stdout
    assert read_json(out / "runs" / "fedavg-nodp-seed0" / "config.json")["federated"]["momentum"] == 0.0


@pytest.mark.parametrize(
    "args, mentions",
    [
        (("--out", "{tmp}/report.html"), "names a report file"),
        (("--out", "{tmp}/o", "--target", "round:3"), "round:3"),
    ],
)
def test_outputs_and_targets_that_cannot_work_are_refused_first(study, tmp_path, args, mentions):
    study_file, _, _ = study
    result = compare("--study", study_file, *(a.format(tmp=tmp_path) for a in args))
    assert_user_error(result, mentions=mentions)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "attack, mentions",
    [
        ({"max_records": "abc"}, "--max-records"),
        ({"bootstrap": 50.5}, "--bootstrap"),
        ({"target": 5}, "--target"),
        ({"seed": -1}, "--seed"),
        ({"per_layer": "yes"}, "--per-layer"),
        ({"online": "no", "methods": ["lira"], "references": 2}, "--online"),  # a non-empty string is no boolean
        ({"bootstrap": 10_000_000_000}, "--bootstrap"),
    ],
)
def test_malformed_attack_settings_are_one_sentence(tmp_path, attack, mentions):
    study = write_study(tmp_path, attack={**STUDY["attack"], **attack})
    assert_user_error(compare("--study", study, "--out", tmp_path / "out"), mentions=mentions)
    assert not (tmp_path / "out").exists()


def test_the_same_run_given_twice_is_planned_once(tmp_path):
    study = load_study(write_study(tmp_path, budgets=["sigma:1", "sigma:1.0", "none", "no-dp"], seeds=[0, 0]))
    assert [run.name for run in plan(study)] == [
        "fedavg-sigma1-seed0",
        "fedlap-sigma1-seed0",
        "fedavg-nodp-seed0",
        "fedlap-nodp-seed0",
    ]


def test_results_the_study_no_longer_asks_for_are_removed(study, tmp_path):
    study_file, original, _ = study
    out = Path(shutil.copytree(original, tmp_path / "out"))
    result = compare("--study", study_file, "--out", out, "--signal", "confidence")
    assert result.exit_code == 0, result.output
    assert result.stdout.count("no longer asks for: loss-threshold") == len(NAMES)
    for name in NAMES:
        assert sorted(p.name for p in (out / "runs" / name / "attacks").iterdir()) == ["confidence-threshold"]
    assert {a["signal"] for run in read_json(out / "summary.json")["runs"] for a in run["attacks"]} == {"confidence"}


def test_out_must_be_a_study_directory(study, tmp_path):
    study_file, _, _ = study
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert_user_error(compare("--study", study_file, "--out", tmp_path / "other"), mentions="not a fedaudit study")
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]


def test_policy_gates_the_study(study, tmp_path):
    study_file, original, _ = study
    out = Path(shutil.copytree(original, tmp_path / "out"))
    policy = tmp_path / "policy.yaml"
    policy.write_text("max_epsilon: 25\n")
    result = compare("--study", study_file, "--out", out, "--policy", policy)
    assert result.exit_code == 1 and "Policy: FAIL" in result.stdout  # the no-DP runs have no guarantee
    groups = pd.read_csv(out / "groups.csv")
    assert list(groups["policy_passed"]) == [2, 2, 0, 0] and (groups["policy_checked"] == 2).all()


def test_the_readme_s_study_and_policy_examples_are_valid(tmp_path):
    from fedaudit.reports.policy import load_policy

    fashion_mnist()  # the study's plan reads the clients' sizes

    docs = Path(__file__).parents[2] / "docs"
    readme = "".join((docs / page).read_text(encoding="utf-8") for page in ("report.md", "compare.md"))
    blocks = [block.split("\n", 1)[1] for block in readme.split("```yaml")[1:]]
    blocks = [block[: block.index("```")] for block in blocks]
    policy_text, study_text = blocks
    (tmp_path / "policy.yaml").write_text(policy_text)
    policy = load_policy(tmp_path / "policy.yaml")
    assert policy.limits() == {
        "max_epsilon": 8,
        "max_attack_auc": 0.6,
        "max_tpr_at_0_1pct_fpr": 0.01,
        "max_tpr_at_1pct_fpr_per_client": 0.05,
        "min_accuracy": 0.7,
    }
    assert policy.delta == 1e-5
    (tmp_path / "study.yaml").write_text(study_text)
    study = load_study(tmp_path / "study.yaml")
    assert study.policy == str(tmp_path / "policy.yaml") and study.formats == ("html", "pdf")
    runs = plan(study)
    assert len(runs) == 3 * 3 * 3 and runs[0].name == "fedavg-eps2-seed0"
    assert runs[0].config.federated.local_steps == 200  # FedLAP-DP's 4 * 5 * 10 queries per round


def test_canaries_go_to_every_dp_run_of_a_study():
    base = RunConfig().with_overrides({"audit.canaries": 100})
    study = Study(algorithms=("fedavg", "fedlap"), budgets=(Budget.parse("none"), Budget.parse("sigma:1")), base=base)
    canaries = {run.name: run.config.audit.canaries for run in plan(study)}
    assert canaries == {
        "fedavg-nodp-seed0": 0,
        "fedlap-nodp-seed0": 0,
        "fedavg-sigma1-seed0": 100,
        "fedlap-sigma1-seed0": 100,
    }
    for run in plan(study):
        run.config.resolved()  # every planned configuration is valid


def test_canary_clients_go_only_to_the_client_level_runs_of_a_study():
    base = RunConfig().with_overrides({"audit.canary_clients": 4})
    budgets = tuple(Budget.parse(b) for b in ("none", "sigma:1", "client:sigma:1"))
    study = Study(algorithms=("fedavg",), budgets=budgets, base=base, max_update_norm=1.0)
    planted = {run.name: run.config.audit.canary_clients for run in plan(study)}
    assert planted == {"fedavg-nodp-seed0": 0, "fedavg-sigma1-seed0": 0, "fedavg-client-sigma1-seed0": 4}
    for run in plan(study):
        run.config.resolved()  # every planned configuration is valid (none was before)


def test_a_study_can_ask_for_reference_model_attacks(tmp_path):
    attack = {"signals": ["loss"], "methods": ["threshold", "rmia"], "references": 2, "online": True}
    study = load_study(write_study(tmp_path, attack=attack))
    assert study.attack.references == 2 and study.attack.online is True and "rmia" in study.attack.methods
    study.attack.validate()
    bad = write_study(tmp_path, attack={**attack, "references": 3})
    with pytest.raises(UserError, match="even"):
        load_study(bad).attack.validate()  # what compare checks before it trains anything


def test_the_plan_estimates_the_time_from_one_timed_round_and_a_long_study_needs_yes(tmp_path, monkeypatch):
    """The estimate is the timed first round times the rounds left (FedAvg and FedLAP timed once each, with and
    without DP); past the limit the study is refused before anything is written unless --yes, or in CI, where it
    starts: takes its lock, writes study.json and carries out its runs (here up to the point where the runs would
    be trained, which the other tests of this file do in full)."""
    import fedaudit.study as study_module
    from fedaudit.reports.render import ReportOutcome

    started = []

    def carry_out(folder, study, planned, *args, **kwargs):
        started.append((folder, len(planned)))
        return ReportOutcome((), {}, None)

    timed = []

    def first_round(setup):
        timed.append((setup.config.federated.algorithm, setup.config.privacy.dp))
        return 3.0 if setup.config.federated.algorithm == "fedlap" else 1.0

    monkeypatch.setattr(study_module, "time_first_round", first_round)
    monkeypatch.setattr(study_module, "_time_signals", lambda setup, attack: 0.0)
    monkeypatch.setattr(study_module, "CONFIRM_SECONDS", 30)
    monkeypatch.delenv("CI", raising=False)
    study = write_study(tmp_path)
    result = compare("--study", study, "--out", tmp_path / "out")
    assert sorted(timed) == [("fedavg", False), ("fedavg", True), ("fedlap", False), ("fedlap", True)]
    # 2 seeds x 2 budgets x 2 rounds: FedAvg 8 rounds of 1 s, FedLAP 8 of 3 s
    assert "about 32 s (training 32 s, attacks 0 s;" in result.stdout
    assert_user_error(result, mentions="--yes")
    assert not (tmp_path / "out").exists()
    assert started == []
    monkeypatch.setattr(study_module, "_carry_out", carry_out)
    monkeypatch.setenv("CI", "true")
    small = ("--algorithm", "fedavg", "--seed", "0", "--no-equal-data-access")
    result = compare("--study", study, "--out", tmp_path / "ci", *small)
    assert result.exit_code == 0, result.output  # in CI a long study starts
    monkeypatch.delenv("CI")
    result = compare("--study", study, "--out", tmp_path / "yes", *small, "--yes")
    assert result.exit_code == 0, result.output
    assert started == [(tmp_path / "ci", 2), (tmp_path / "yes", 2)]  # 2 budgets x 1 seed of FedAvg each
    assert all((folder / "study.json").is_file() for folder, _ in started)


def test_durations_are_said_in_the_unit_a_reader_expects():
    assert [_duration(s) for s in (0.4, 119, 120, 1630, 7199, 7200, 10080)] == [
        "0 s", "119 s", "2 min", "27 min", "120 min", "2.0 h", "2.8 h",
    ]  # fmt: skip


def test_a_study_being_run_refuses_a_second_compare_naming_its_pid(study, tmp_path):
    import os

    from fedaudit.rundir.integrity import RunLock

    study_file, original, _ = study
    out = Path(shutil.copytree(original, tmp_path / "out"))
    (out / ".study.json.abcd1234.tmp").write_text("half of study.json")  # what an interrupted compare leaves
    with RunLock(out, "fedaudit compare"):
        line = assert_user_error(compare("--study", study_file, "--out", out))
        assert f"in use by pid {os.getpid()} (fedaudit compare)" in line
    assert compare("--study", study_file, "--out", out).exit_code == 0
    assert not list(out.glob("*.tmp"))


def test_compare_takes_the_options_of_the_user_s_data_its_dataset_help_names(tmp_path):
    """--dataset's help (train's) sends csv: data to --label-column, and sites to --site-data: compare takes them
    too (it refused both, though its own error asked for them)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    table = pd.DataFrame(x[:300], columns=[f"p{i}" for i in range(64)]).assign(digit=y[:300])
    table.to_csv(tmp_path / "records.csv", index=False)
    out = tmp_path / "study"
    args = ("--algorithm", "fedavg", "--budget", "none", "--rounds", "1", "--model", "mlp", "--width", "8")
    result = invoke(
        "compare",
        "--dataset",
        f"csv:{tmp_path / 'records.csv'}",
        "--label-column",
        "digit",
        *args,
        "--depth",
        "1",
        "--num-clients",
        "2",
        "--out",
        out,
        "--no-progress",
    )
    assert result.exit_code == 0, result.output
    data = json.loads((out / "study.json").read_text())["study"]["base"]["data"]
    assert (data["label_column"], data["sites"]) == ("digit", [])


def test_two_budgets_that_would_share_their_runs_names_are_refused(tmp_path):
    """sigma:1 and sigma:1.0000001 both name their runs ...-sigma1-...: the second was dropped from the plan without a
    word (one run planned for two budgets); the same budget written twice is still one run."""
    args = ("--algorithm", "fedavg", "--rounds", "1", "--out", tmp_path / "s")
    result = invoke("compare", *args, "--budget", "sigma:1", "--budget", "sigma:1.0000001")
    assert_user_error(result, mentions="sigma:1.0 and sigma:1.0000001 give their runs one name (fedavg-sigma1-seed0)")
    assert not (tmp_path / "s").exists()
    study = Study(budgets=(Budget.parse("sigma:1"), Budget.parse("sigma:1.0")), algorithms=("fedavg",))
    assert [run.name for run in plan(study)] == ["fedavg-sigma1-seed0"]


def test_a_canary_study_audits_the_runs_that_have_canaries_and_attacks_the_others_without(tmp_path):
    """A budget of none drops the base's canaries: that run gets the other attacks, not a canary audit that cannot
    work (it failed the whole study after training, every time it was run)."""
    base = {**BASE, "audit": {"canaries": 16}}
    attack = {"signals": ["loss"], "methods": ["threshold", "canary"], "max_records": 200, "bootstrap": 50}
    study = write_study(tmp_path, algorithms=["fedavg"], budgets=["sigma:1", "none"], seeds=[0], base=base,
                        attack=attack, equal_data_access=False)  # fmt: skip
    result = compare("--study", study, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "no canary audit: the run has no canaries" in result.output
    runs = tmp_path / "out" / "runs"
    assert (runs / "fedavg-sigma1-seed0" / "attacks" / "update-projection-canary").is_dir()
    assert sorted(p.name for p in (runs / "fedavg-nodp-seed0" / "attacks").iterdir()) == ["loss-threshold"]


@pytest.mark.parametrize("kind", ["link", "file"])
def test_a_link_or_a_file_where_a_run_belongs_is_one_sentence(tmp_path, kind):
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    args = ("--out", out, "--algorithm", "fedavg", "--budget", "none", "--width", "8", "--rounds", "1")
    assert compare(*args, "--signal", "loss", "--method", "threshold").exit_code == 0
    where = out / "runs" / "fedavg-nodp-seed0"
    shutil.rmtree(where)
    where.symlink_to(victim) if kind == "link" else where.write_text("x")
    before = (out / "study.json").read_bytes()
    result = compare(*args, "--signal", "loss", "--method", "threshold")
    assert_user_error(result, mentions="symbolic link" if kind == "link" else "not a directory")
    assert list(victim.iterdir()) == [] and (out / "study.json").read_bytes() == before


def test_the_estimate_counts_reference_models_of_runs_it_keeps(study, tmp_path, monkeypatch):
    """A finished study asked again for LiRA trains K reference models per run: the estimate counts them, timing a
    first round although no run is left to train."""
    import fedaudit.study as study_module

    study_file, out, _ = study
    copy = Path(shutil.copytree(out, tmp_path / "copy"))
    monkeypatch.setattr(study_module, "time_first_round", lambda setup: 2.0)
    monkeypatch.setattr(study_module, "_time_signals", lambda setup, attack: 0.0)
    monkeypatch.setattr(study_module, "CONFIRM_SECONDS", 30)
    monkeypatch.delenv("CI", raising=False)
    lira = {**STUDY["attack"], "methods": ["threshold", "lira"], "references": 4}
    result = compare("--study", write_study(tmp_path, attack=lira), "--out", copy)
    assert_user_error(result, mentions="--yes")
    # 8 runs x 4 references x 2 rounds x 2 s
    assert "attacks 2 min;" in result.stdout, result.stdout
