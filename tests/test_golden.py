"""The same runs, attacks and reports as the code made before: one small run per algorithm is trained, attacked and
reported, and every file is compared with tests/golden/runs.json (made by the code before a change of shape; how,
and what is compared on this machine and on another: tests/support/golden.py)."""

from __future__ import annotations

import copy
import json

import pytest
from golden import COMMON, GOLDEN, RUNS, differences, machine, make, snapshot

import fedaudit


@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("golden") / "golden"
    make(out)
    return snapshot(out)


def test_every_algorithm_s_run_attack_and_report_are_the_golden_ones(golden, made) -> None:
    """Byte for byte on the machine that made the golden runs; elsewhere the same files, the same portable files and
    the same skeletons (tests/support/golden.py says why no more holds across CPUs)."""
    exact = machine() == golden["machine"]
    assert differences(made, golden["files"], exact=exact) == []
    assert {name.split("/")[0] for name in made} == {*RUNS, "report"}


def _changed(files: dict, name: str, **entry: str) -> dict:
    changed = copy.deepcopy(files)
    changed[name].update(entry)
    return changed


@pytest.mark.parametrize("exact", [True, False], ids=["golden-machine", "another-machine"])
def test_a_changed_file_is_caught_as_far_as_the_machine_allows(golden, exact: bool) -> None:
    """The comparison itself: a file lost or added, a portable file changed, a run file's text changed beyond its
    numbers are caught on any machine; a model's numbers changed only on the golden machine."""
    files = golden["files"]
    lost = {key: value for key, value in files.items() if key != "fedprox/metrics.csv"}
    added = {**files, "fedprox/extra.json": files["fedprox/metrics.csv"]}
    portable = _changed(files, "fedprox/config.json", sha256="0" * 64)
    worded = _changed(
        files,
        "fedprox/metrics.csv",
        sha256="1" * 64,
        skeleton=files["fedprox/metrics.csv"]["skeleton"].replace("test_accuracy", "accuracy"),
    )
    for found in (lost, added, portable, worded):
        assert differences(found, files, exact=exact) != []
    retrained = _changed(files, "fedlap/model.safetensors", sha256="2" * 64, bytes_sha256="3" * 64)
    assert (differences(retrained, files, exact=exact) != []) == exact
    exposed = _changed(files, "fedlap/attacks/loss-threshold/metrics.json", sha256="4" * 64, skeleton="another")
    assert (differences(exposed, files, exact=exact) != []) == exact
    assert differences(files, files, exact=exact) == []


def test_a_run_trained_with_another_setting_is_not_the_golden_one(golden, tmp_path) -> None:
    """A planted change (FedProx's proximal term ten times stronger) is caught: by the model on the golden machine,
    by the configuration on any."""
    out = tmp_path / "golden"
    fedaudit.train(None, out / "fedprox", algorithm="fedprox", mu=1.0, echo=lambda _: None, **COMMON)
    found = snapshot(out)
    expected = {name: entry for name, entry in golden["files"].items() if name in found}  # no attack results here
    assert any(line.startswith("fedprox/model.safetensors") for line in differences(found, expected, exact=True))
    assert any(line.startswith("fedprox/config.json") for line in differences(found, expected, exact=False))
