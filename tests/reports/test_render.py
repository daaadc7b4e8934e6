"""fedaudit.reports.render: where a report goes (output_paths) and what write_report writes for real runs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd
import pytest
from helpers import read_json, tree_digest

from fedaudit.reports.collect import ReportError, RunSummary, collect_runs
from fedaudit.reports.render import FORMATS, output_paths, write_report
from fedaudit.reports.summary import fmt

SUMMARIES = ("summary.csv", "groups.csv", "summary.json")


@pytest.fixture(scope="module")
def summaries(plain_run: Path, dp_run: Path) -> list[RunSummary]:
    """The plain FedAvg run and the DP-FedAvg run, collected once (both directories are called "run")."""
    return collect_runs([plain_run, dp_run])


# ---------------------------------------------------------------------------- output_paths


def test_formats_are_html_md_and_pdf():
    assert FORMATS == ("html", "md", "pdf")


@pytest.mark.parametrize(
    "name, formats, expected",
    [
        ("audit.html", (), {"html": "audit.html"}),
        ("audit.md", (), {"md": "audit.md"}),
        ("audit.pdf", (), {"pdf": "audit.pdf"}),
        ("Audit.HTML", (), {"html": "Audit.html"}),  # the suffix is read case-insensitively
        ("audit.html", ("html", "md"), {"html": "audit.html", "md": "audit.md"}),  # other formats beside it
        ("audit.md", ("pdf", "md", "pdf"), {"pdf": "audit.pdf", "md": "audit.md"}),  # each format once
    ],
)
def test_a_report_file_names_the_report_and_its_folder_gets_the_summaries(tmp_path, name, formats, expected):
    targets, folder = output_paths(tmp_path / name, formats)
    assert targets == {fmt_: tmp_path / file for fmt_, file in expected.items()}
    assert list(targets) == list(expected)
    assert folder == tmp_path


@pytest.mark.parametrize(
    "name, formats, expected",
    [
        ("out", (), {"html": "report.html"}),  # html by default
        ("out", ("md", "pdf"), {"md": "report.md", "pdf": "report.pdf"}),
        ("reports", ("md",), {"md": "report.md"}),
    ],
)
def test_a_path_without_a_report_suffix_is_a_folder(tmp_path, name, formats, expected):
    targets, folder = output_paths(tmp_path / name, formats)
    assert folder == tmp_path / name
    assert targets == {fmt_: tmp_path / name / file for fmt_, file in expected.items()}
    assert not (tmp_path / name).exists()  # output_paths only plans; it creates nothing


def test_existing_folder_is_used(tmp_path):
    (tmp_path / "out").mkdir()
    assert output_paths(tmp_path / "out", ()) == ({"html": tmp_path / "out" / "report.html"}, tmp_path / "out")
    (tmp_path / "results.v2").mkdir()  # a folder whose name has a dot that is no report suffix
    assert output_paths(tmp_path / "results.v2", ())[1] == tmp_path / "results.v2"


@pytest.mark.parametrize("name", ["x.csv", "results.v2", "report.txt"])
def test_a_new_path_with_another_suffix_is_refused_not_made_a_folder(tmp_path, name):
    with pytest.raises(ReportError, match="neither a folder nor a report file"):
        output_paths(tmp_path / name, ())
    assert not (tmp_path / name).exists()


def test_a_format_that_contradicts_the_suffix_of_out_is_refused(tmp_path):
    """--out audit.html --format md: the file named would not be written; say so instead of writing audit.md."""
    with pytest.raises(ReportError, match="names a html report but --format asks for md"):
        output_paths(tmp_path / "audit.html", ("md",))


@pytest.mark.parametrize("formats", [("docx",), ("html", "xlsx"), ("",)])
def test_an_unknown_format_is_refused(tmp_path, formats):
    with pytest.raises(ReportError) as caught:
        output_paths(tmp_path / "audit.html", formats)
    message = str(caught.value)
    unknown = next(f for f in formats if f not in FORMATS)
    assert f"Unknown --format {unknown!r}" in message and "html, md, pdf" in message
    assert "\n" not in message


@pytest.mark.parametrize("out", ["taken", "taken/audit.html"])
def test_a_folder_that_is_a_file_is_refused(tmp_path, out):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ReportError, match="exists and is not a directory") as caught:
        output_paths(tmp_path / out, ())
    assert str(tmp_path / "taken") in str(caught.value)


# ---------------------------------------------------------------------------- write_report


@pytest.fixture(scope="module")
def written(summaries, tmp_path_factory) -> tuple[Path, object]:
    """HTML and Markdown report of both runs, written once."""
    out = tmp_path_factory.mktemp("render") / "audit.html"
    return out, write_report(summaries, out, ("html", "md"), None)


def test_write_report_writes_html_md_and_the_summaries_beside_them(written):
    out, outcome = written
    folder = out.parent
    expected = [folder / "audit.html", folder / "audit.md", *(folder / name for name in SUMMARIES)]
    assert list(outcome.written) == expected
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in expected)
    assert outcome.verdict is None and outcome.checks == {}


def test_the_report_names_both_runs_algorithms_and_epsilon(written, dp_run):
    out, _ = written
    epsilon = read_json(dp_run / "privacy.json")["epsilon_per_round"][-1]
    assert epsilon == pd.read_csv(dp_run / "metrics.csv")["epsilon"].iloc[-1]
    for text in (out.read_text(encoding="utf-8"), out.with_suffix(".md").read_text(encoding="utf-8")):
        assert "DP-FedAvg" in text
        assert re.search(r"(?<!DP-)FedAvg", text)  # the plain run's algorithm on its own
        assert fmt(epsilon) in text  # the DP run's epsilon, as the tables show it
        assert "epsilon is infinite" in text  # the plain run has no guarantee
        assert "run (1)" in text and "run (2)" in text  # two directories of one name are told apart


def test_summary_csv_holds_each_runs_numbers_exactly(written, summaries, dp_run):
    out, _ = written
    rows = pd.read_csv(out.parent / "summary.csv")
    assert rows["run"].tolist() == ["run (1)", "run (2)"]
    assert rows["algorithm"].tolist() == ["FedAvg", "DP-FedAvg"]
    assert rows["dp"].tolist() == [False, True]
    assert math.isinf(rows["epsilon"][0])
    assert rows["epsilon"][1] == read_json(dp_run / "privacy.json")["epsilon_per_round"][-1]  # read back exactly
    assert rows["final_accuracy"].tolist() == [s.final_accuracy for s in summaries]
    assert rows["rounds"].tolist() == [3, 3]


def test_summary_json_is_strict_json_with_infinite_epsilon_flagged(written, plain_run, dp_run):
    out, _ = written
    text = (out.parent / "summary.json").read_text(encoding="utf-8")
    summary = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in summary.json"))
    assert (summary["format"], summary["format_version"], summary["verdict"]) == ("fedaudit-report", 1, None)
    plain, dp = summary["runs"]
    assert (plain["name"], plain["path"], plain["setup"]["algorithm"]) == ("run (1)", str(plain_run), "FedAvg")
    assert (dp["name"], dp["path"], dp["setup"]["algorithm"]) == ("run (2)", str(dp_run), "DP-FedAvg")
    assert plain["privacy"]["epsilon"] is None and plain["privacy"]["epsilon_infinite"] is True
    assert dp["privacy"]["epsilon"] == read_json(dp_run / "privacy.json")["epsilon_per_round"][-1]
    assert dp["privacy"]["epsilon_infinite"] is False
    assert dp["privacy"]["epsilon_per_round"] == read_json(dp_run / "privacy.json")["epsilon_per_round"]


def test_markdown_alone_writes_no_html(summaries, tmp_path):
    outcome = write_report(summaries, tmp_path / "out", ("md",), None)
    assert [p.name for p in outcome.written] == ["report.md", *SUMMARIES]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(["report.md", *SUMMARIES])
    assert "DP-FedAvg" in (tmp_path / "out" / "report.md").read_text(encoding="utf-8")


@pytest.mark.parametrize(
    "out, formats",
    [
        ("taken", ("html",)),
        ("taken/audit.md", ()),
        ("fresh/audit.html", ("docx",)),
        ("fresh", ("md", "odt")),
    ],
    ids=["folder is a file", "parent is a file", "unknown format", "one unknown format of two"],
)
def test_nothing_is_written_when_the_output_path_is_invalid(summaries, tmp_path, out, formats):
    (tmp_path / "taken").write_text("a file")
    before = tree_digest(tmp_path)
    with pytest.raises(ReportError):
        write_report(summaries, tmp_path / out, formats, None)
    assert tree_digest(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_a_run_named_as_markdown_stays_text_in_the_markdown_report(plain_run, tmp_path):
    """A run folder named as a Markdown image whose URL hides its slashes in entities: rendered by two Markdown
    renderers, the report fetches nothing from that host and shows the name as text."""
    import shutil

    import markdown
    from helpers import invoke
    from markdown_it import MarkdownIt

    name = "![p](https:&#47;&#47;evil.example&#47;t.png)"
    run = tmp_path / name
    shutil.copytree(plain_run, run)
    assert invoke("report", str(run), "--out", str(tmp_path / "r.md")).exit_code == 0
    text = (tmp_path / "r.md").read_text()
    for html in (markdown.markdown(text, extensions=["tables"]), MarkdownIt().enable("table").render(text)):
        assert "<img" not in html and 'src="https' not in html
        assert "evil.example" in html  # the name is still shown, as text


def test_groups_hold_runs_that_differ_only_in_their_seed_whatever_their_labels(plain_run):
    """A group's label may itself hold " (" (client level, FedGM's mechanism): two settings under one label are still
    told apart (they were merged, their accuracies averaged); and runs that differ only in how many clients ran at
    once or where Flower ran them stay one group (they were split)."""
    from dataclasses import replace

    from fedaudit.reports.collect import seedless_config
    from fedaudit.reports.summary import group_names

    (plain,) = collect_runs([plain_run])
    config = json.loads((plain_run / "config.json").read_text())
    other = {**config, "data": {**config["data"], "partition": "iid"}}
    setup = {**plain.setup, "algorithm": "DP-FedAvg (client level)", "privacy budget": "sigma 1 per client"}
    runs = [
        replace(plain, name=name, setup=setup, seedless_config=seedless_config(setting))
        for name, setting in (("a", config), ("b", other), ("c", config))
    ]
    names = group_names(runs)
    assert names == [
        "DP-FedAvg (client level), sigma 1 per client",
        "DP-FedAvg (client level), sigma 1 per client (2)",
        "DP-FedAvg (client level), sigma 1 per client",
    ]
    moved = {**config, "parallel_clients": 2, "flower": {"ray_address": "127.0.0.1:6379"}}
    assert seedless_config(moved) == seedless_config(config)


def test_the_members_that_would_show_leakage_are_counted_at_the_simultaneous_interval_s_level(plain_run, dp_run):
    """The sentence judges leakage on the interval that holds for all of a run's K attacks at once (Bonferroni), so
    the members it says would show the leakage come from that interval's z, not from 1.96: about z^2 / (6 d^2)."""
    from scipy.stats import norm

    from fedaudit.reports.summary import findings, group_rows, summary_rows

    rows = summary_rows(collect_runs([plain_run, dp_run]), {})
    plain = ~rows["dp"].astype(bool)
    columns = [
        "attack_auc",
        "attack_auc_simultaneous_ci_low",
        "attacks_compared",
        "attack_members",
        "attack_nonmembers",
    ]
    rows.loc[plain, columns] = [0.53, 0.49, 4, 300, 300]
    (sentence,) = [s for s in findings(rows, group_rows(rows)) if "cannot tell DP from no DP" in s]
    expected = math.ceil((norm.ppf(1 - 0.05 / 8) / 0.03) ** 2 / 6)  # 1,156; at 1.96 it would be 712
    assert f"would take about {expected} members" in sentence


def test_a_group_s_accuracy_interval_over_seeds_stays_within_0_and_1() -> None:
    """Student's t over two or three seeds can reach below 0 (a review saw [-0.067, 0.501]): cut to [0, 1]."""
    from scipy.stats import t

    from fedaudit.reports.summary import _accuracy_interval

    group = pd.Series({"runs": 3, "final_accuracy_n": 3, "final_accuracy_std": 0.12, "final_accuracy_mean": 0.1})
    half = t.ppf(0.975, 2) * 0.12 / math.sqrt(3)
    assert 0.1 - half < 0 and _accuracy_interval(group) == pytest.approx((0.0, 0.1 + half))
    group["final_accuracy_mean"] = 0.95
    assert _accuracy_interval(group) == pytest.approx((0.95 - half, 1.0))
