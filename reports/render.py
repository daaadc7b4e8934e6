"""Build a report: figures and tables into jinja2 templates, written as HTML, Markdown, PDF and summaries."""

from __future__ import annotations

import base64
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

import pandas as pd
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from markupsafe import Markup, escape

from fedaudit.reports import figures
from fedaudit.reports.collect import ReportError, RunSummary
from fedaudit.reports.guarantee import attacks_sentence, coverage_table, guarantees_table
from fedaudit.reports.policy import Check, Policy, check_run, overall
from fedaudit.reports.summary import (
    attack_table,
    client_risk_table,
    comparison_table,
    epsilon_table,
    exposed_table,
    findings,
    fmt,
    group_rows,
    group_table,
    interval,
    policy_table,
    privacy_table,
    reconstruction_client_table,
    reconstruction_table,
    setup_table,
    summary_json,
    summary_rows,
)
from fedaudit.reports.verdict import run_verdict
from fedaudit.rundir import (
    RUN_FORMAT,
    atomic_write_bytes,
    atomic_write_json,
    csv_bytes,
    now_iso,
    remove_stale_temporaries,
)

FORMATS = ("html", "md", "pdf")
SUFFIXES = {f".{name}": name for name in FORMATS}


@dataclass(frozen=True)
class ReportOutcome:
    """What a report wrote and the policy's overall verdict."""

    written: tuple[Path, ...]
    checks: dict[str, list[Check]]
    verdict: str | None  # PASS, FAIL or INCONCLUSIVE (reports.policy.overall); None without a policy
    broken: dict[str, str] = field(default_factory=dict)  # run -> why it fails without a policy (files, DP promise)


SUMMARIES = ("summary.csv", "groups.csv", "summary.json")  # written beside every report


def _writable(folder: Path, out: str | Path) -> None:
    """The folder exists and can be written to, or its nearest existing ancestor is a directory that can be: a
    file on the way (existingfile/sub) or a place nobody may write to (/proc, /sys) is one sentence."""
    ancestor = folder.absolute()
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ReportError(f"--out {out}: {ancestor} is not a directory, so nothing can be written under it.")
    if (
        not os.access(ancestor, os.W_OK | os.X_OK)
        or ancestor.is_relative_to("/proc")
        or ancestor.is_relative_to("/sys")
    ):
        raise ReportError(f"--out {out}: {ancestor} cannot be written to; choose another place.")


def output_paths(
    out: str | Path, formats: tuple[str, ...], *, overwrite: bool = True, folder_only: bool = False
) -> tuple[dict[str, Path], Path]:
    """Report files by format and the folder of summary.csv/json, checked before anything is computed.

    ``--out report.html`` names the report (other formats of ``--format`` get the same stem beside it; the suffix's
    own format must be among them); an ``--out`` without a suffix, or an existing folder, is a folder that receives
    report.<format>. Anything else (an empty path, another suffix, a folder inside a run directory, and without
    ``overwrite`` an existing report or summary) is a :class:`ReportError`. With ``folder_only`` (a study's
    directory), ``out`` is a folder whatever its name.
    """
    if not str(out).strip():
        raise ReportError("--out must name a report file (.html, .md or .pdf) or a folder, not an empty path.")
    path = Path(out)
    for name in formats:
        if name not in FORMATS:
            raise ReportError(f"Unknown --format {name!r}; choose from {', '.join(FORMATS)}.")
    suffix = path.suffix.lower()
    if folder_only:
        suffix = ""
    if suffix in SUFFIXES and not path.is_dir():
        if formats and SUFFIXES[suffix] not in formats:
            raise ReportError(
                f"--out {out} names a {SUFFIXES[suffix]} report but --format asks for {', '.join(formats)}; give --out "
                "a folder, or a file with one of those suffixes."
            )
        chosen = formats or (SUFFIXES[suffix],)
        folder, stem = path.parent, path.stem
    elif suffix and not path.is_dir():
        raise ReportError(f"--out {out} is neither a folder nor a report file ending in .html, .md or .pdf.")
    else:
        chosen = formats or ("html",)
        folder, stem = path, "report"
    if folder.exists() and not folder.is_dir():
        raise ReportError(f"--out {out}: {folder} exists and is not a directory.")
    _writable(folder, out)
    run = _inside_run(folder)
    if run is not None:
        raise ReportError(f"--out {out} is inside the run directory {run}; write reports outside runs.")
    targets = {name: folder / f"{stem}.{name}" for name in dict.fromkeys(chosen)}
    unfinished = _unfinished(folder)
    existing = [p for p in (*targets.values(), *(folder / s for s in SUMMARIES)) if p.exists() and p not in unfinished]
    if existing and not overwrite:
        raise ReportError(f"--out {out}: {existing[0]} already exists; pass --overwrite to replace the report.")
    return targets, folder


PARTIAL = ".fedaudit-report.partial"  # beside a report being written: the files it writes; removed when done


def _unfinished(folder: Path) -> set[Path]:
    """The files a report that was killed while writing into ``folder`` left (its marker lists them): the next
    report may replace them without --overwrite, as the same command given again."""
    try:
        names = json.loads((folder / PARTIAL).read_text(encoding="utf-8")).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {folder / str(name) for name in names if isinstance(name, str) and "/" not in name}


def _inside_run(folder: Path) -> Path | None:
    """The run directory that ``folder`` is or lies in, if any (its manifest.json carries fedaudit's format tag)."""
    for candidate in (folder.resolve(), *folder.resolve().parents):
        manifest = candidate / "manifest.json"
        if manifest.is_file():
            try:
                if json.loads(manifest.read_text(encoding="utf-8")).get("format") == RUN_FORMAT:
                    return candidate
            except (OSError, ValueError, AttributeError):
                continue
    return None


def _b64(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode("ascii")


def _run_context(run: RunSummary, checks: list[Check] | None, draw: bool) -> dict[str, Any]:
    """Tables, figures (when ``draw``) and statements of one run section."""
    final = run.final_attacks
    curves = [(a.label, a) for a in final if a.roc is not None]
    per_round = [a for a in run.attacks if a.round is not None]
    rounds_attacked = {a.round for a in per_round}
    has_accuracy = {"round", "test_accuracy"} <= set(run.utility.columns) and not run.utility.empty
    figs = (
        {
            "accuracy": _b64(figures.accuracy_curve(run)) if has_accuracy else None,
            "epsilon": _b64(figures.epsilon_curve(run)) if run.privacy.epsilon_per_round else None,
            "roc": _b64(figures.roc_curves(curves, f"ROC, round {run.rounds_done}")) if curves else None,
            "canaries": _b64(figures.canary_audit(run.canary_audits)) if run.canary_audits else None,
            "auc_rounds": _b64(figures.auc_per_round(per_round, "Attack AUC per round"))
            if len(rounds_attacked) > 1
            else None,
            "synthetic": [
                (
                    number,
                    _b64(
                        figures.synthetic_grid(
                            [s for s in run.synthetic if s.round == number], f"Synthetic sets sent in round {number}"
                        )
                    ),
                )
                for number in sorted({s.round for s in run.synthetic})
            ],
            "reconstruction": _b64(
                figures.reconstruction_grid(
                    run.reconstructions, "Originals (top) and what the attack rebuilt (bottom), closest first"
                )
            )
            if any(r.images is not None for r in run.reconstructions)
            else None,
        }
        if draw
        else {}
    )
    strongest = run.strongest_attack
    compared = run.attacks_compared
    return {
        "run": run,
        "setup": setup_table(run),
        "privacy": privacy_table(run) if run.privacy.dp and run.privacy.epsilon_per_round else None,
        "epsilons": epsilon_table(run),
        "utility": run.utility.assign(**{c: run.utility[c].map(fmt) for c in run.utility.columns if c != "round"}),
        "attacks": attack_table(run.attacks, run.privacy.dp) if run.attacks else None,
        "strongest": strongest,
        "canaries": run.canary_audits,
        "inverted": [a for a in run.attacks if a.inverted],
        "client_risk": client_risk_table(strongest) if strongest else None,
        "exposed": exposed_table(strongest) if strongest else None,
        "strongest_ci": interval(strongest.auc_ci) if strongest else None,
        "strongest_simultaneous_ci": interval(strongest.simultaneous_ci(compared)) if strongest else None,
        "strongest_simultaneous": strongest.simultaneous_ci(compared) if strongest else None,
        "compared": compared,
        "accuracy_ci": interval(run.final_accuracy_ci),
        "bound": run.epsilon_lower_bound(),
        "exceeds": _exceeds(run),
        "promise": promise(run),
        "coverage": coverage_table(run),
        "attacks_sentence": attacks_sentence(run),
        "reconstruction": reconstruction_table(run.reconstruction_rounds, run.privacy.dp)
        if run.reconstructions
        else None,
        "reconstruction_clients": reconstruction_client_table(run) if len(run.reconstructions) > 1 else None,
        "reconstruction_rounds": run.reconstruction_rounds,
        "figures": figs,
        "checks": policy_table(checks) if checks else None,
        "verdict": None if checks is None else overall(checks),
    }


def _reconstruction_epsilon(runs: list[RunSummary]) -> str | None:
    """The figure of reconstruction quality against epsilon: one point per run and attacked round (None when fewer
    than two points, or no run was attacked so)."""
    points = [
        {
            "algorithm": run.setup["algorithm"],
            "epsilon": math.inf if not run.privacy.dp else r.accountant_epsilon,
            "psnr": r.quality["psnr"]["mean"],
            "psnr_low": (r.quality["psnr"]["ci95"] or [math.nan])[0],
            "psnr_high": (r.quality["psnr"]["ci95"] or [math.nan, math.nan])[1],
            "null_psnr": r.null_quality["psnr"]["mean"],
            "threshold": r.threshold,
        }
        for run in runs
        for r in run.reconstruction_rounds
        if (r.accountant_epsilon is not None or not run.privacy.dp) and r.quality["psnr"]["mean"] is not None
    ]
    if len(points) < 2:
        return None
    return _b64(figures.reconstruction_epsilon(pd.DataFrame(points)))


def _exceeds(run: RunSummary) -> dict[str, Any] | None:
    """The evidence of a broken DP implementation, if any: the attack whose epsilon lower bound (Bonferroni over every
    attack of the run, 95%) exceeds the accountant's epsilon of its round by the most."""
    dp = {a.name: a for a in run.attacks if a.accountant_epsilon is not None}
    bounds = run.corrected_bounds(tuple(dp.values()))
    excess = {
        name: bound - dp[name].accountant_epsilon
        for name, bound in bounds.items()
        if bound > dp[name].accountant_epsilon
    }
    if not excess:
        return None
    name = max(excess, key=excess.__getitem__)
    return {"attack": name, "bound": bounds[name], "accountant": dp[name].accountant_epsilon, "attacks": len(bounds)}


def promise(run: RunSummary) -> dict[str, Any] | None:
    """ "Does the implementation keep its promise?" for a DP run: each conformance check of `fedaudit verify`, each
    canary view's bound beside the accountant, a verdict (FAIL when a check failed or a bound exceeds the accountant,
    PASS when both kinds of evidence exist, every check could be made and they agree, else NOT CHECKED) and what
    could not be checked."""
    if not run.privacy.dp or not run.privacy.epsilon_per_round:
        return None
    failures: list[str] = []
    unchecked: list[str] = []
    checks = []
    verification = run.verification
    if verification is None:
        needs = (
            " on a run trained with --save-transmitted"
            if run.privacy.client_level
            else " on a run trained with --canaries"
        )
        unchecked.append(
            "the mechanism's conformance (noise, clipping, sampling, the ledger recomputed with dp-accounting) was not "
            f"verified: run `fedaudit verify {run.path}`"
            + ("" if run.canary_audits and not run.privacy.client_level else needs)
        )
    else:
        checks = [
            {"name": c.name, "verdict": "PASS" if c.passed else "FAIL", "p_value": c.p_value, "sentence": c.sentence}
            for c in verification.checks
            if c.checked
        ]
        unchecked += [
            f"conformance, {c.name}: {c.sentence.removeprefix('Not checked: ').rstrip('.')}"
            for c in verification.checks
            if not c.checked
        ]
        failures += [f"{c.name}: {c.sentence}" for c in verification.failed]
        if not verification.current:
            unchecked.append(
                f"verify saw {verification.rounds} rounds and the run now has {run.rounds_done}: verify it again"
            )
    views = []
    for a in run.canary_audits:
        estimate = (a.canary_audit or {}).get("estimate") or None
        above = bool(a.accountant_epsilon is not None and a.epsilon_lower_bound > a.accountant_epsilon)
        views.append(
            {
                "view": a.name,
                "bound": a.epsilon_lower_bound,
                "accountant": a.accountant_epsilon,
                "ratio": None if not a.accountant_epsilon else a.epsilon_lower_bound / a.accountant_epsilon,
                "estimate": None if estimate is None else estimate.get("epsilon"),
                "estimate_ci": None if estimate is None else estimate.get("ci95"),
                "informative": (a.canary_audit or {}).get("informative_canaries"),
                "canaries": (a.canary_audit or {}).get("canaries"),
                "verdict": "FAIL" if above else "PASS",
            }
        )
        if above:
            failures.append(
                f"the {a.name} audit proves epsilon >= {fmt(a.epsilon_lower_bound)} (95%), above the accountant's "
                f"{fmt(a.accountant_epsilon)}"
            )
    if not run.canary_audits:
        planted = "--canary-clients N" if run.privacy.client_level else "--dp --canaries N"
        unchecked.append(
            f"no canary audit: how much the released queries leak was not measured (train with {planted}, then "
            "attack with --method canary)"
        )
    partial = verification is not None and (
        not verification.current or any(not c.checked for c in verification.checks)  # a stale verify checked less
    )
    verdict = "FAIL" if failures else ("NOT CHECKED" if verification is None or not views or partial else "PASS")
    return {"verdict": verdict, "checks": checks, "views": views, "failures": failures, "unchecked": unchecked}


def code_spans(text: str) -> Markup:
    """HTML of a sentence whose `backticked` parts are commands: each becomes <code>, everything escaped."""
    parts = str(text).split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: plain text
        return Markup(escape(str(text)))
    return Markup("".join(f"<code>{escape(p)}</code>" if i % 2 else str(escape(p)) for i, p in enumerate(parts)))


_BARE_AMPERSAND = re.compile(r"&(?!(?:lt|gt|amp);)")
_IMAGE_OPENING = re.compile(r"(?<!\\)!\[")  # ![ opens an image
_LINK_TARGET = re.compile(r"\]\(")  # ]( joins a link's text to its target


class MarkdownCode(str):
    """A whole Markdown code span (:func:`md_code`): printed as it is, its text literal."""


_BACKTICK_RUN = re.compile(r"`+")


def md_code(value: Any) -> MarkdownCode:
    """``value`` as one Markdown code span that shows its text literally (``<`` stays ``<``): fenced by more
    backticks than the longest run inside it, padded where it starts or ends with one, on one line."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    fence = "`" * (max((len(run) for run in _BACKTICK_RUN.findall(text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return MarkdownCode(f"{fence}{pad}{text}{pad}{fence}")


def md_text(value: Any) -> Any:
    """A value as Markdown text that cannot open an HTML tag (a run named ``<script>`` stays text) or smuggle a
    link (a run named ``![p](https:&#47;&#47;host&#47;t.png)`` would become an image fetched from that host):
    ``<``, ``>`` and every ``&`` that does not start one of those three entities become entities, and the ``!`` of
    ``![`` and the ``(`` of ``](`` are backslash-escaped (no image or inline link can form), which Markdown shows as
    the characters. Text between a pair of single backticks is a code span, which Markdown shows literally, so it is
    left as it is (a suggested command keeps its ``<``), but only where every renderer pairs the backticks as this
    does: single ones, none escaped by a backslash; otherwise everything is escaped. Idempotent, so a macro's output
    passes unchanged; a :class:`MarkdownCode` passes as it is."""
    if isinstance(value, MarkdownCode):
        return value
    if isinstance(value, PurePath):
        value = str(value)
    if not isinstance(value, str):
        return value
    parts = value.split("`")
    paired = len(parts) % 2 == 1 and "\\`" not in value and "``" not in value
    if not paired:
        return _md_plain(value)
    return "`".join(part if i % 2 else _md_plain(part) for i, part in enumerate(parts))


def _md_plain(text: str) -> str:
    """Text outside code spans, escaped as :func:`md_text` says."""
    text = _BARE_AMPERSAND.sub("&amp;", text).replace("<", "&lt;").replace(">", "&gt;")
    return _LINK_TARGET.sub(r"]\\(", _IMAGE_OPENING.sub(r"\\![", text))


def _environment(*, markdown: bool = False) -> Environment:
    """The templates' environment: HTML autoescaped; Markdown (``markdown``) with every printed value through
    :func:`md_text`."""
    env = Environment(
        loader=PackageLoader("fedaudit.reports", "templates"),
        autoescape=select_autoescape(["html", "txt"]),
        finalize=md_text if markdown else None,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = fmt
    env.filters["code_spans"] = code_spans
    env.filters["md_code"] = md_code
    env.filters["md_cell"] = lambda value: str(value).replace("|", "\\|").replace("\n", " ")
    return env


def build_context(
    runs: list[RunSummary], policy: Policy | None, created: str, draw: bool = True
) -> tuple[dict[str, Any], dict[str, list[Check]], pd.DataFrame, pd.DataFrame]:
    """The template context (with figures when ``draw``), the policy checks per run, the summary rows and the groups
    of runs that differ only in their seed."""
    checks = {run.name: check_run(policy, run) for run in runs} if policy else {}
    rows = summary_rows(runs, checks)
    groups = group_rows(rows)
    overlay = [
        (run.name, run.strongest_attack)
        for run in runs
        if run.strongest_attack is not None and run.strongest_attack.roc is not None
    ]
    sections = [_run_context(run, checks.get(run.name) if policy else None, draw) for run in runs]
    context = {
        "created": created,
        "runs": sections,
        "verdicts": [run_verdict(s["run"], s["promise"], s["exceeds"], s["verdict"]) for s in sections],
        "guarantee": guarantees_table(runs),
        "policy": policy,
        "all_checks": policy_table([c for group in checks.values() for c in group]) if policy else None,
        "verdict": None if policy is None else overall([c for group in checks.values() for c in group]),
        "comparison": comparison_table(rows) if len(runs) > 1 else None,
        "overlay": _b64(figures.roc_curves(overlay, "Strongest attack per run"))
        if draw and len(runs) > 1 and overlay
        else None,
        "groups": group_table(groups) if len(groups) < len(runs) else None,
        "findings": findings(rows, groups) if len(runs) > 1 else [],
        "tradeoff": _b64(figures.privacy_utility(groups)) if draw and len(runs) > 1 else None,
        "reconstruction_epsilon": _reconstruction_epsilon(runs) if draw and len(runs) > 1 else None,
        "tradeoff_caption": figures.spread_caption(groups),
    }
    return context, checks, rows, groups


def write_report(
    runs: list[RunSummary],
    out: str | Path,
    formats: tuple[str, ...],
    policy: Policy | None,
    *,
    folder_only: bool = False,
) -> ReportOutcome:
    """Render and write the requested formats plus summary.csv, groups.csv and summary.json (each file atomically)."""
    targets, folder = output_paths(out, formats, folder_only=folder_only)  # overwrite: checked before runs were read
    created = now_iso()
    context, checks, rows, groups = build_context(runs, policy, created, draw=bool({"html", "pdf"} & set(targets)))
    env = _environment()
    html = env.get_template("report.html").render(**context) if {"html", "pdf"} & set(targets) else ""
    rendered: dict[Path, bytes] = {}
    for name, path in targets.items():
        if name == "md":
            rendered[path] = _environment(markdown=True).get_template("report.md").render(**context).encode("utf-8")
        else:
            rendered[path] = html.encode("utf-8") if name == "html" else _pdf(html)
    rendered[folder / "summary.csv"] = csv_bytes(rows)
    rendered[folder / "groups.csv"] = csv_bytes(groups)
    summary = summary_json(runs, checks, policy, created, groups)
    rendered[folder / "summary.json"] = (json.dumps(summary, indent=2, allow_nan=False) + "\n").encode("utf-8")
    marker = folder / PARTIAL
    names = [path.name for path in rendered]
    remove_stale_temporaries(folder, ("",), names=names)  # what a killed report left half-written
    try:
        atomic_write_json(marker, {"files": names})
        for path, data in rendered.items():
            atomic_write_bytes(path, data)
        marker.unlink()
    except OSError as exc:
        raise ReportError(f"Cannot write the report to {folder}: {exc.strerror or exc}.") from exc
    verdict = None if policy is None else overall([c for group in checks.values() for c in group])
    broken = {
        run["run"].name: "the DP implementation does not keep its promise: " + "; ".join(run["promise"]["failures"])
        for run in context["runs"]
        if run["promise"] is not None and run["promise"]["verdict"] == "FAIL"
    }
    for run in context["runs"]:
        if run["run"].integrity:
            why = f"its files are not those fedaudit wrote: {'; '.join(run['run'].integrity)}"
            broken[run["run"].name] = why + (f"; {broken[run['run'].name]}" if run["run"].name in broken else "")
    return ReportOutcome(tuple(rendered), checks, verdict, broken)


def _pdf(html: str) -> bytes:
    """The HTML report laid out as PDF by WeasyPrint (the HTML has no external references to fetch)."""
    import logging

    try:
        from weasyprint import HTML
    except (ImportError, OSError) as exc:
        raise ReportError(
            "--format pdf needs WeasyPrint and the Pango library (Debian: apt-get install libpango-1.0-0 "
            f"libpangoft2-1.0-0), which could not be loaded: {exc}."
        ) from exc
    logging.getLogger("weasyprint").setLevel(logging.ERROR)
    logging.getLogger("fontTools").setLevel(logging.ERROR)
    return HTML(string=html).write_pdf()
