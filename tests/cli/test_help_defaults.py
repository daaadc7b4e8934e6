"""What ``fedaudit train --help`` shows as each option's default is what the configuration does: a literal default
equals the configuration field's, and a default that depends on the dataset, the algorithm or DP names every value
the configuration resolves to (so a changed default that the help text does not follow fails here)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import pytest

from fedaudit.cli import train
from fedaudit.config import RunConfig, option_field
from fedaudit.registry import ALGORITHMS

# Defaults that say what happens rather than a value (resolved at run time from the data, the machine or the
# clients): nothing to compare.
DESCRIBED = {
    "noise_seed",
    "image_size",
    "depth",
    "label_epsilon",
    "synthetic_per_client",
    "keep_checkpoints",
    "eval_sample",
    "ray_address",
    "client_gpus",
    "parallel_clients",
    "count_noise",
}
DATASETS = ("digits", "fashion-mnist", "mnist", "cifar10")


def shown_defaults() -> dict[str, str]:
    shown = {}
    for param in train.params:
        found = re.search(r"\[default(?: with --dp)?: ([^\]]+)\]$", getattr(param, "help", None) or "")
        if found and param.name != "progress":
            shown[param.name] = found.group(1)
    return shown


def field_value(config: RunConfig, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def resolved_values(name: str) -> set[Any]:
    """Every value the option's field takes once the configuration is resolved, over datasets, algorithms and DP."""
    values = set()
    for dataset, algorithm, dp in itertools.product(DATASETS, ALGORITHMS, (False, True)):
        if dp and not ALGORITHMS[algorithm].record_dp:
            continue
        overrides = {"federated.algorithm": algorithm, "data.dataset": dataset, "privacy.dp": dp}
        config = RunConfig().with_overrides({**overrides, "federated.rounds": 2}).resolved()
        values.add(field_value(config, option_field(name)))
    return values - {None}


def mentions(text: str, value: Any) -> bool:
    if isinstance(value, bool):
        return ("on" if value else "off") in text.split()
    if isinstance(value, (int, float)):
        numbers = re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.])", text)
        return any(float(number) == pytest.approx(value) for number in numbers)
    return re.search(rf"(?<![\w-]){re.escape(str(value))}(?![\w-])", text) is not None


def test_every_default_train_shows_is_checked_here() -> None:
    shown = shown_defaults()
    assert len(shown) >= 70
    assert DESCRIBED <= set(shown)


@pytest.mark.parametrize("name", sorted(set(shown_defaults()) - DESCRIBED))
def test_a_shown_default_is_the_configuration_s(name: str) -> None:
    text = shown_defaults()[name]
    literal = field_value(RunConfig(), option_field(name))
    if literal is not None:
        if isinstance(literal, (int, float)) and not isinstance(literal, bool):
            assert float(text) == pytest.approx(literal), (text, literal)
        elif isinstance(literal, bool):
            assert text == ("on" if literal else "off"), (text, literal)
        else:
            assert text == str(literal), (text, literal)
        return
    values = resolved_values(name)
    assert values, f"--{name} shows a default ({text!r}) that the configuration never resolves"
    missing = sorted((v for v in values if not mentions(text, v)), key=str)
    assert not missing, f"--{name} shows [default: {text}] but resolves to {missing} too"


@pytest.mark.parametrize(
    "planted, name",
    [
        ("Communication rounds M. [default: 12]", "rounds"),
        ("Channels (ConvNet) or hidden units (MLP). [default: 128; 16 on digits]", "width"),
        ("Client learning rate eta_c. [default: 0.1]", "lr"),
    ],
)
def test_a_help_text_gone_stale_is_caught(planted: str, name: str, monkeypatch) -> None:
    (param,) = [p for p in train.params if p.name == name]
    monkeypatch.setattr(param, "help", planted)
    with pytest.raises(AssertionError):
        test_a_shown_default_is_the_configuration_s(name)


def test_every_configuration_option_is_generated_from_its_field() -> None:
    """One place per setting: each option of train that sets a configuration field carries the field's own help
    text and shown default (fedaudit.options), so cli.py types none of them by hand."""
    from fedaudit.config import option_fields
    from fedaudit.options import help_text, option_name

    by_name = {p.name: p for p in train.params}
    generated = option_fields()
    assert len(generated) >= 80
    for path, field, _ in generated:
        param = by_name[option_name(field)]
        assert option_field(param.name) == path
        assert param.help == help_text(field), path


def test_help_lists_the_options_by_concern() -> None:
    """--help has one section per concern, in fedaudit.options.GROUPS' order with the algorithms' own sections after
    them, and each option under its own: --rounds under Federation, --noise-multiplier under Privacy, --radius under
    FedLAP's, --superlink under Engine (where the clients run)."""
    from click.testing import CliRunner

    from fedaudit.options import GROUPS

    text = CliRunner().invoke(train, ["--help"], terminal_width=200).output
    titles = re.findall(r"^(\S[^\n]*) options:$", text, flags=re.MULTILINE)
    assert titles[: len(GROUPS)] == list(GROUPS)
    assert set(titles[len(GROUPS) :]) == {"FedLAP and FedLAP-DP", "FedDM", "FedGM", "Fedssyn"}
    sections = dict(zip(titles, re.split(r"^\S[^\n]* options:$", text, flags=re.MULTILINE)[1:]))
    for title, option in [
        ("Federation", "--rounds"),
        ("Privacy", "--noise-multiplier"),
        ("FedLAP and FedLAP-DP", "--radius"),
        ("Engine", "--superlink"),
        ("Run", "--out"),
    ]:
        assert re.search(rf"^\s+{option}\b", sections[title], flags=re.MULTILINE), (title, option)
        assert sum(bool(re.search(rf"^\s+{option}\b", s, flags=re.MULTILINE)) for s in sections.values()) == 1


def test_every_attack_option_is_its_field_s_with_the_field_s_default() -> None:
    """attack's options of what to attack and how come from fedaudit.attacks.options' fields: the help text and
    shown default are the field's, and the value an option takes when not given is the field's default (the
    library's AttackOptions() and the command line attack alike)."""

    from fedaudit.attacks.options import AttackOptions, ReconstructionOptions
    from fedaudit.cli import attack
    from fedaudit.options import help_text, option_of

    by_name = {p.name: p for p in attack.params}
    fields = [f for kind in (AttackOptions, ReconstructionOptions) for f in dataclasses.fields(kind) if option_of(f)]
    assert len(fields) == 15
    for field in fields:
        param = by_name[field.name]
        assert param.help == help_text(field), field.name
        if param.multiple:
            assert field.default  # not given: empty, and the library's default applies (fedaudit.api.attack)
        else:
            assert param.default == field.default, field.name


def test_attack_s_help_names_every_method_it_accepts() -> None:
    """The --method help text is written by hand: each registered method is named there (client was missing)."""
    from fedaudit.attacks.registry import ATTACKS
    from fedaudit.cli import attack

    text = re.sub(r"\([^)]*\)", "", {p.name: p for p in attack.params}["methods"].help)  # the names, not their notes
    listed = {item.split()[0] for item in re.split(r",|;| or ", text.split("repeat for several")[0]) if item.strip()}
    assert set(ATTACKS) <= listed, sorted(set(ATTACKS) - listed)


def test_compare_shows_the_study_s_own_defaults() -> None:
    """compare's options repeat attack's shown defaults (derived from the same fields), and its own options are the
    study settings' fields (help and shown default from each field), whose defaults are what a study without them
    gets (Study())."""
    from fedaudit.attacks.options import AttackOptions
    from fedaudit.cli import attack, compare
    from fedaudit.options import help_text, option_of, shown_default
    from fedaudit.study import Study
    from fedaudit.study_settings import StudySettings

    def shown(command, name: str) -> str:
        (param,) = [p for p in command.params if p.name == name]
        found = re.search(r"\[default: ([^\]]+)\]$", param.help)
        assert found, name
        return found.group(1)

    by_name = {param.name: param for param in compare.params}
    given = compare.make_context("compare", ["--out", "study"]).params
    own = [field for field in dataclasses.fields(StudySettings) if option_of(field)]
    assert [field.name for field in own] == [
        "algorithms",
        "budgets",
        "seeds",
        "equal_data_access",
        "formats",
        "max_update_norm",
        "policy",
    ]
    for field in own:
        assert by_name[field.name].help == help_text(field), field.name
        assert given[field.name] in (None, ()), field.name  # not given: the study file's value stands
    study = Study()
    assert shown(compare, "algorithms") == ", ".join(study.algorithms)
    assert shown(compare, "budgets") == ", ".join(str(b) for b in study.budgets)
    assert shown(compare, "seeds") == ", ".join(str(s) for s in study.seeds)
    assert shown(compare, "equal_data_access") == ("on" if study.equal_data_access else "off")
    assert shown(compare, "formats") == ", ".join(study.formats)
    for name in ("signals", "methods", "target"):
        (field,) = [f for f in dataclasses.fields(AttackOptions) if f.name == name]
        assert shown(compare, name) == shown_default(field) == shown(attack, name)
