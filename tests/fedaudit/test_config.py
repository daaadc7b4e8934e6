"""RunConfig: defaults, resolution of algorithm defaults, validation messages, JSON/YAML round trips."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from fedaudit.config import (
    ConfigError,
    DataConfig,
    FederatedConfig,
    FedLAPConfig,
    ModelConfig,
    PrivacyConfig,
    RunConfig,
    load_config_file,
    mark_calibrated,
)

# A configuration with every basic field away from its default.
CUSTOM = RunConfig(
    seed=42,
    device="cpu",
    data=DataConfig(
        dataset="fashion-mnist",
        data_dir="/data",
        download=True,
        partition="dirichlet:0.5",
        num_clients=7,
        holdout_fraction=0.2,
    ),
    model=ModelConfig(arch="mlp", width=32, depth=1),
    federated=FederatedConfig(
        algorithm="fedprox",
        rounds=3,
        client_fraction=0.5,
        weighting="uniform",
        server_lr=0.5,
        local_epochs=2,
        client_lr=0.05,
        momentum=0.9,
        batch_size=16,
        mu=0.01,
        lr_schedule="cosine",
    ),
    privacy=PrivacyConfig(dp=True, noise_multiplier=1.3, max_grad_norm=0.5, delta=1e-6, accountant="prv"),
)


def dp(**privacy) -> RunConfig:
    return RunConfig(privacy=PrivacyConfig(dp=True, **privacy))


def message(config: RunConfig) -> str:
    with pytest.raises(ConfigError) as info:
        config.resolved()
    text = str(info.value)
    assert "\n" not in text and text.endswith(".")  # one sentence
    return text


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("config", [RunConfig(), CUSTOM, CUSTOM.resolved()], ids=["default", "custom", "resolved"])
def test_dict_json_and_yaml_round_trips(config):
    as_dict = config.to_dict()
    assert RunConfig.from_dict(as_dict) == config
    assert RunConfig.from_dict(json.loads(json.dumps(as_dict))) == config
    assert RunConfig.from_dict(yaml.safe_load(yaml.safe_dump(as_dict))) == config


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml", ".JSON"])
def test_load_config_file_reads_json_and_yaml(tmp_path, suffix):
    path = tmp_path / f"config{suffix}"
    data = CUSTOM.to_dict()
    path.write_text(json.dumps(data) if suffix.lower() == ".json" else yaml.safe_dump(data))
    assert load_config_file(path) == CUSTOM


def test_load_config_file_partial_and_empty(tmp_path):
    partial = tmp_path / "partial.yaml"
    partial.write_text("federated:\n  rounds: 3\nmodel:\n  width: 8\nseed: 5\n")
    config = load_config_file(partial)
    assert config == RunConfig(seed=5, model=ModelConfig(width=8), federated=FederatedConfig(rounds=3))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config_file(empty) == RunConfig()
    null_section = tmp_path / "null.yaml"
    null_section.write_text("privacy:\n")
    assert load_config_file(null_section) == RunConfig()


def test_yaml_reads_exponents_as_numbers(tmp_path):
    # PyYAML's YAML 1.1 rules read 1e-5 as a string; people write delta and learning rates like this.
    path = tmp_path / "c.yaml"
    path.write_text(
        "privacy:\n  dp: true\n  delta: 1e-5\n  noise_multiplier: 2E0\nfederated:\n  client_lr: 5e-2\n"
        "  server_lr: 1.5e+0\n"
    )
    config = load_config_file(path)
    assert config.privacy.delta == 1e-5 and config.privacy.noise_multiplier == 2.0
    assert config.federated.client_lr == 0.05 and config.federated.server_lr == 1.5
    path.write_text("data:\n  partition: '1e5'\n  dataset: digits\nseed: 10\n")
    config = load_config_file(path)  # quoted stays a string, plain integers stay integers
    assert (config.data.partition, config.data.dataset, config.seed) == ("1e5", "digits", 10)


def test_with_overrides_applies_dotted_fields_and_ignores_none():
    base = RunConfig()
    changed = base.with_overrides({"federated.rounds": 3, "model.arch": None, "seed": 9, "privacy.dp": True})
    assert (changed.federated.rounds, changed.model.arch, changed.seed, changed.privacy.dp) == (3, "convnet", 9, True)
    assert base == RunConfig()  # frozen: the original is untouched
    with pytest.raises(ConfigError, match="federated.learning_rate"):
        base.with_overrides({"federated.learning_rate": 0.1})


# ---------------------------------------------------------------------------- resolved()


@pytest.mark.parametrize("algorithm, clip", [("fedavg", 0.1), ("fedprox", 0.2), ("fedsgd", 0.1)])
def test_resolved_fills_algorithm_defaults_with_dp(algorithm, clip):
    """The authors' DP configurations on the paper's datasets."""
    config = RunConfig(
        data=DataConfig(dataset="fashion-mnist"),
        federated=FederatedConfig(algorithm=algorithm),
        privacy=PrivacyConfig(dp=True),
    ).resolved()
    assert config.privacy.max_grad_norm == clip
    assert config.privacy.noise_multiplier == 1.0
    assert config.federated.client_lr == 0.1
    assert config.federated.lr_schedule in ("constant", "cosine")
    assert config.resolved() == config  # idempotent


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox", "fedsgd"])
def test_dp_sgd_defaults_on_digits_take_a_larger_step_and_clipping_norm(algorithm):
    """digits barely learns under DP-SGD with the Fashion-MNIST step and norm; the step is the same without DP, and
    given values win."""
    config = RunConfig(federated=FederatedConfig(algorithm=algorithm), privacy=PrivacyConfig(dp=True)).resolved()
    assert (config.federated.client_lr, config.privacy.max_grad_norm) == (0.5, 1.0)
    plain = RunConfig(federated=FederatedConfig(algorithm=algorithm)).resolved()
    assert plain.federated.client_lr == 0.5
    given = RunConfig(
        federated=FederatedConfig(algorithm=algorithm, client_lr=0.2), privacy=PrivacyConfig(dp=True, max_grad_norm=0.3)
    ).resolved()
    assert (given.federated.client_lr, given.privacy.max_grad_norm) == (0.2, 0.3)
    lap = RunConfig(federated=FederatedConfig(algorithm="fedlap"), privacy=PrivacyConfig(dp=True)).resolved()
    assert (lap.federated.client_lr, lap.privacy.max_grad_norm) == (0.02, 1.0)  # FedLAP's own digits step


def test_digits_has_its_own_width_and_fedlap_dp_settings_and_the_paper_datasets_keep_the_authors():
    """Measured on digits (docs/algorithms.md): width 32, and FedLAP-DP with one trajectory of two real batches per
    loop, a trust region of 5 and a step of 0.02; Fashion-MNIST keeps the paper's width 128 and the authors' FedLAP-DP
    configuration; given values win everywhere."""
    digits = RunConfig(federated=FederatedConfig(algorithm="fedlap"), privacy=PrivacyConfig(dp=True)).resolved()
    lap = digits.fedlap
    assert (digits.model.width, lap.trajectories, lap.real_batches, lap.radius) == (32, 1, 2, 5.0)
    assert (lap.ipc, lap.model_epochs, lap.mse_weight) == (10, 2, 0.0)  # the authors' DP values otherwise
    fashion = RunConfig(
        data=DataConfig(dataset="fashion-mnist"),
        federated=FederatedConfig(algorithm="fedlap"),
        privacy=PrivacyConfig(dp=True),
    ).resolved()
    lap = fashion.fedlap
    assert (fashion.model.width, fashion.federated.client_lr, lap.trajectories, lap.real_batches, lap.radius) == (
        128, 0.002, 4, 10, 1.5,
    )  # fmt: skip
    plain = RunConfig(federated=FederatedConfig(algorithm="fedlap")).resolved().fedlap
    assert (plain.trajectories, plain.real_batches, plain.radius) == (1, 40, 10.0)  # non-DP: the authors' FedLAP
    given = RunConfig(
        model=ModelConfig(width=64),
        federated=FederatedConfig(algorithm="fedlap"),
        privacy=PrivacyConfig(dp=True),
        fedlap=FedLAPConfig(trajectories=3, radius=1.0),
    ).resolved()
    assert (given.model.width, given.fedlap.trajectories, given.fedlap.radius) == (64, 3, 1.0)


def test_resolved_keeps_given_values_and_leaves_sigma_to_calibration():
    given = dp(noise_multiplier=2.5, max_grad_norm=3.0).resolved()
    assert (given.privacy.noise_multiplier, given.privacy.max_grad_norm) == (2.5, 3.0)
    targeted = dp(target_epsilon=4.0).resolved()
    assert targeted.privacy.noise_multiplier is None  # found by calibration in training.prepare
    assert targeted.privacy.max_grad_norm == 1.0  # the digits default of DP-SGD
    custom = CUSTOM.resolved()
    assert (custom.federated.client_lr, custom.federated.lr_schedule) == (0.05, "cosine")


def test_resolved_batch_size_is_the_paper_s_except_on_the_small_digits_data():
    assert RunConfig(data=DataConfig(dataset="fashion-mnist")).resolved().federated.batch_size == 256
    assert RunConfig().resolved().federated.batch_size == 32  # digits: about 250 records per default client
    assert CUSTOM.resolved().federated.batch_size == 16


def test_resolved_without_dp_writes_no_mechanism():
    config = RunConfig().resolved()
    assert config.privacy.noise_multiplier is None and config.privacy.max_grad_norm is None
    unset = {name for name, value in dataclasses.asdict(config.federated).items() if value is None}
    assert unset == {"local_steps"}  # the only optional knob: epochs decide the steps unless it is given


def test_mark_calibrated_keeps_the_target():
    config = mark_calibrated(dp(target_epsilon=4.0).resolved(), 1.75)
    assert (config.privacy.noise_multiplier, config.privacy.target_epsilon, config.privacy.calibrated) == (
        1.75,
        4.0,
        True,
    )
    assert config.resolved() == config  # a calibrated sigma next to its target is valid
    assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# ---------------------------------------------------------------------------- validation


INVALID = {
    "rounds-zero": (RunConfig(federated=FederatedConfig(rounds=0)), "--rounds"),
    "rounds-bool": (RunConfig(federated=FederatedConfig(rounds=True)), "--rounds"),
    "rounds-float": (RunConfig(federated=FederatedConfig(rounds=2.5)), "--rounds"),
    "algorithm": (RunConfig(federated=FederatedConfig(algorithm="fedmagic")), "fedmagic"),
    "client-fraction": (RunConfig(federated=FederatedConfig(client_fraction=1.5)), "--client-fraction"),
    "weighting": (RunConfig(federated=FederatedConfig(weighting="random")), "--weighting"),
    "server-lr": (RunConfig(federated=FederatedConfig(server_lr=0)), "--server-lr"),
    "local-epochs": (RunConfig(federated=FederatedConfig(local_epochs=0)), "--local-epochs"),
    "lr": (RunConfig(federated=FederatedConfig(client_lr=-0.1)), "--lr"),
    "momentum": (RunConfig(federated=FederatedConfig(momentum=1.0)), "--momentum"),
    "batch-size": (RunConfig(federated=FederatedConfig(batch_size=0)), "--batch-size"),
    "mu": (RunConfig(federated=FederatedConfig(mu=-1.0)), "--mu"),
    "lr-schedule": (RunConfig(federated=FederatedConfig(lr_schedule="step")), "--lr-schedule"),
    "num-clients": (RunConfig(data=DataConfig(num_clients=0)), "--num-clients"),
    "holdout": (RunConfig(data=DataConfig(holdout_fraction=1.0)), "--holdout-fraction"),
    "width": (RunConfig(model=ModelConfig(width=0)), "--width"),
    "depth": (RunConfig(model=ModelConfig(depth=-1)), "--depth"),
    "device": (RunConfig(device="tpu"), "--device"),
    "seed-negative": (RunConfig(seed=-1), "--seed"),
    "seed-beyond-32-bits": (RunConfig(seed=2**32), "--seed"),
    "seed-bool": (RunConfig(seed=True), "--seed"),
    "accountant": (RunConfig(privacy=PrivacyConfig(accountant="moments")), "--accountant"),
    "delta": (RunConfig(privacy=PrivacyConfig(delta=0.0)), "--delta"),
    "sigma-zero": (dp(noise_multiplier=0.0), "--noise-multiplier"),
    "sigma-negative": (dp(noise_multiplier=-1.0), "--noise-multiplier"),
    "sigma-nan": (dp(noise_multiplier=float("nan")), "--noise-multiplier"),
    "clip-zero": (dp(max_grad_norm=0.0), "--max-grad-norm"),
    "clip-inf": (dp(max_grad_norm=float("inf")), "--max-grad-norm"),
    "target-zero": (dp(target_epsilon=0.0), "--target-epsilon"),
    "sigma-and-target": (dp(noise_multiplier=1.0, target_epsilon=3.0), "not both"),
    "sigma-without-dp": (RunConfig(privacy=PrivacyConfig(noise_multiplier=1.0)), "--dp"),
    "clip-without-dp": (RunConfig(privacy=PrivacyConfig(max_grad_norm=1.0)), "--dp"),
    "target-without-dp": (RunConfig(privacy=PrivacyConfig(target_epsilon=1.0)), "--dp"),
    "dp-string": (RunConfig(privacy=PrivacyConfig(dp="false")), "--dp"),
    "download-string": (RunConfig(data=DataConfig(download="no")), "--download"),
    "data-dir-number": (RunConfig(data=DataConfig(data_dir=5)), "--data-dir"),
}


@pytest.mark.parametrize("config, option", list(INVALID.values()), ids=list(INVALID))
def test_invalid_values_name_the_option_in_one_sentence(config, option):
    assert option in message(config)


def test_valid_edge_values_pass():
    RunConfig(
        data=DataConfig(holdout_fraction=0.0, num_clients=1),
        model=ModelConfig(depth=0),
        federated=FederatedConfig(client_fraction=1.0, momentum=0.0, mu=0.0),
    ).resolved()
    dp(noise_multiplier=1e-3, max_grad_norm=1e-3, delta=0.999).resolved()


# ---------------------------------------------------------------------------- from_dict and files


BAD_DICTS = {
    "unknown-section": ({"optimizer": {"lr": 0.1}}, "optimizer"),
    "unknown-key": ({"federated": {"learning_rate": 0.1}}, "learning_rate"),
    "section-not-mapping": ({"data": "digits"}, "data"),
    "not-a-mapping": ([1, 2], "mapping"),
}


@pytest.mark.parametrize("data, mentions", list(BAD_DICTS.values()), ids=list(BAD_DICTS))
def test_from_dict_rejects_unknown_and_malformed(data, mentions):
    with pytest.raises(ConfigError, match=mentions):
        RunConfig.from_dict(data)


BAD_FILES = {
    "malformed-yaml": ("c.yaml", b"federated: [rounds: 3", "not valid YAML"),
    "malformed-json": ("c.json", b'{"federated": ', "not valid JSON"),
    "malformed-JSON-suffix": ("C.JSON", b'{"federated": ', "not valid JSON"),
    "binary": ("c.yaml", b"\xff\xfe\x00\x00\x81", "UTF-8"),
    "unknown-key": ("c.yaml", b"model:\n  layers: 3\n", "layers"),
    "bad-value": ("c.json", b'{"federated": {"rounds": -3}}', "--rounds"),
    "list": ("c.yaml", b"- 1\n", "mapping"),
}


@pytest.mark.parametrize("name, content, mentions", list(BAD_FILES.values()), ids=list(BAD_FILES))
def test_load_config_file_errors(tmp_path, name, content, mentions):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_config_file(path)
    assert mentions in str(info.value) and "\n" not in str(info.value)


def test_load_config_file_missing_or_a_directory(tmp_path):
    with pytest.raises(ConfigError, match="Cannot read the configuration file"):
        load_config_file(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="Cannot read the configuration file"):
        load_config_file(Path(tmp_path))


def test_a_key_given_twice_a_number_too_long_or_a_date_that_is_none_is_one_sentence(tmp_path) -> None:
    """The last of two keys won without a word (a policy of max_epsilon 1 then 100 passed a run of epsilon 6.5); an
    integer of 5,000 digits or a YAML date such as 2001-13-45 raised a ValueError that no handler caught."""
    from fedaudit.config import JSONRefused, YAMLRefused, load_config_file, load_json, load_yaml

    with pytest.raises(YAMLRefused, match="gives the key 'max_epsilon' twice"):
        load_yaml("max_epsilon: 1\nmax_epsilon: 100\n")
    with pytest.raises(YAMLRefused, match="gives the key 'dp' twice"):
        load_yaml("privacy:\n  dp: true\n  dp: false\n")
    with pytest.raises(JSONRefused, match="gives the key 'seed' twice"):
        load_json('{"seed": 1, "seed": 2}')
    with pytest.raises(YAMLRefused, match="cannot read"):
        load_yaml("seed: 1" + "0" * 5000)
    with pytest.raises(JSONRefused, match="cannot read"):
        load_json('{"seed": 1' + "0" * 5000 + "}")
    assert load_yaml("when: 2001-13-45\nday: 2001-12-14\n") == {"when": "2001-13-45", "day": "2001-12-14"}
    assert load_yaml("a: {x: 1}\nb: {x: 1}\n") == {"a": {"x": 1}, "b": {"x": 1}}  # the same key in two mappings
    for name, text in (("twice.json", '{"seed": 1, "seed": 2}'), ("long.yaml", "seed: 1" + "0" * 5000)):
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=rf"^The configuration file {tmp_path / name} "):
            load_config_file(tmp_path / name)


def test_the_width_limit_is_the_convnet_s_and_an_mlp_may_be_wider():
    from fedaudit.config import MAX_WIDTH

    RunConfig().with_overrides({"model.arch": "mlp", "model.width": 5000, "model.depth": 1}).resolved()
    with pytest.raises(ConfigError, match="--width must be at most"):
        RunConfig().with_overrides({"model.width": MAX_WIDTH + 1}).resolved()
