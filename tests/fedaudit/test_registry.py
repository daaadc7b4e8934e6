"""The registry of algorithms and accountants: one place that names them, and everything else follows it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import toy_algorithm
from click import Choice

from fedaudit import registry
from fedaudit.algorithms.base import get_algorithm
from fedaudit.cli import compare, epsilon, train
from fedaudit.config import ConfigError, RunConfig
from fedaudit.privacy.accounting import SGMEvent, compute_epsilon, round_events
from fedaudit.registry import ACCOUNTANTS, ALGORITHMS


def choices(command, option: str) -> list[str]:
    (param,) = [p for p in command.params if p.name == option]
    assert isinstance(param.type, Choice)
    return list(param.type.choices)


def test_the_command_line_offers_exactly_the_registry() -> None:
    assert choices(train, "algorithm") == list(ALGORITHMS)
    assert choices(compare, "algorithms") == list(ALGORITHMS)
    assert choices(train, "accountant") == list(ACCOUNTANTS)
    assert choices(epsilon, "accountant") == list(ACCOUNTANTS)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_builds_and_takes_its_defaults_from_its_entry(name: str) -> None:
    entry = ALGORITHMS[name]
    for dataset in ("digits", "fashion-mnist"):
        overrides = {"federated.algorithm": name, "data.dataset": dataset, "privacy.dp": entry.record_dp}
        resolved = RunConfig().with_overrides(overrides).resolved()
        assert resolved.federated.client_lr == entry.default_client_lr(dataset)
        if entry.record_dp:
            assert resolved.privacy.max_grad_norm == entry.default_max_grad_norm(dataset)
        else:  # FedGM and FedDM: --dp is refused with one sentence
            with pytest.raises(ConfigError, match="does not apply|runs without DP"):
                RunConfig().with_overrides({**overrides, "privacy.dp": True}).resolved()
        assert get_algorithm(resolved).name == name
    assert registry.algorithm_label(name, dp=True) == entry.dp_label
    assert registry.algorithm_label(name, dp=False) == entry.label


def test_fedprox_reads_mu_from_the_configuration() -> None:
    config = RunConfig().with_overrides({"federated.algorithm": "fedprox", "federated.mu": 0.25}).resolved()
    assert get_algorithm(config).mu == 0.25
    assert get_algorithm(replace(config, federated=replace(config.federated, algorithm="fedavg"))).mu == 0.0


def test_an_algorithm_is_added_by_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._ALGORITHMS, toy_algorithm.ENTRY.name, toy_algorithm.ENTRY)
    config = RunConfig().with_overrides({"federated.algorithm": "fedavg-twice", "privacy.dp": True}).resolved()
    assert (config.federated.client_lr, config.privacy.max_grad_norm) == (0.3, 0.7)
    assert isinstance(get_algorithm(config), toy_algorithm.FedAvgTwice)
    assert registry.algorithm_label("fedavg-twice", dp=True) == "DP-FedAvgTwice"


def test_an_unknown_algorithm_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match="Unknown algorithm 'fedsomething'"):
        RunConfig().with_overrides({"federated.algorithm": "fedsomething"}).resolved()


@pytest.mark.parametrize("name", list(ACCOUNTANTS))
def test_every_accountant_entry_is_what_compute_epsilon_uses(name: str) -> None:
    events = round_events(noise_multiplier=1.1, sample_rate=0.05, queries_per_round=20) * 3 + [
        SGMEvent(noise_multiplier=1.3, sample_rate=0.01, steps=7)
    ]
    eps = compute_epsilon(events, delta=1e-5, accountant=name)
    history = tuple((e.noise_multiplier, e.sample_rate, e.steps) for e in events)
    merged: dict[tuple[float, float], int] = {}
    for sigma, q, steps in history:
        merged[(sigma, q)] = merged.get((sigma, q), 0) + steps
    composed = tuple((sigma, q, steps) for (sigma, q), steps in merged.items())
    assert math.isfinite(eps) and eps > 0
    assert ACCOUNTANTS[name].epsilon(composed, 1e-5) == pytest.approx(eps, rel=1e-9)


def test_every_train_option_sets_one_configuration_field_and_every_field_has_an_option() -> None:
    """Adding a configuration field means adding its option (named after it), and nothing else on the CLI side."""
    from dataclasses import fields

    from fedaudit.config import _SECTION_TYPES, option_field

    not_config = {"config_file", "out", "resume_dir", "overwrite", "progress", "equal_data_access"}
    options = [p.name for p in train.params if p.name not in not_config]
    mapped = [option_field(name) for name in options]
    assert len(set(mapped)) == len(mapped)
    every_field = {f.name for f in fields(RunConfig) if f.name not in _SECTION_TYPES}
    every_field |= {f"{section}.{f.name}" for section, kind in _SECTION_TYPES.items() for f in fields(kind)}
    assert every_field - set(mapped) == {"privacy.calibrated"}  # set by calibration, never by hand
    assert set(mapped) <= every_field


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_an_entry_s_facts_agree_with_its_implementation(name: str) -> None:
    """What the registry says of an algorithm's local training is what its class does (read off the class, not the
    entry), so that the attacks and reports that read the entry simulate and describe the algorithm that ran."""
    from fedaudit.algorithms.fedavg import FedProx
    from fedaudit.algorithms.scaffold import Scaffold

    entry = ALGORITHMS[name]
    implementation = registry.load(entry.implementation)
    assert entry.one_step == bool(getattr(implementation, "single_step", False))
    assert entry.proximal == issubclass(implementation, FedProx)
    assert entry.control_variates == issubclass(implementation, Scaffold)
    assert not (entry.one_step and entry.local_sgd)
    assert entry.wire in (registry.WIRE_UPDATES, registry.WIRE_SYNTHETIC)
    assert entry.dp_unit in (registry.DP_RECORD, registry.DP_LABEL, registry.DP_NONE)
    assert entry.shares_synthetic == any(entry.sends_synthetic(r) for r in range(1, 4))
    for inner in entry.inner_algorithms:  # an inner algorithm sends updates from its first round
        assert not ALGORITHMS[inner].shares_synthetic and not ALGORITHMS[inner].inner_algorithms


def test_every_algorithm_has_a_colour_of_its_own() -> None:
    colours = [entry.colour for entry in ALGORITHMS.values()]
    assert all(len(c) == 7 and c.startswith("#") and int(c[1:], 16) >= 0 for c in colours)
    assert len(set(colours)) == len(colours)
