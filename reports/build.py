"""``fedaudit report`` end to end: check every input, then collect, check the policy and write."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fedaudit.errors import UserError
from fedaudit.reports.collect import TamperedRunError, collect_runs
from fedaudit.reports.policy import load_policy
from fedaudit.reports.render import ReportOutcome, output_paths, write_report


def build_report(
    run_dirs: Sequence[str | Path],
    *,
    out: str | Path,
    formats: Sequence[str] = (),
    policy_file: str | Path | None = None,
    overwrite: bool = False,
) -> ReportOutcome:
    """Write the report of ``run_dirs`` to ``out`` (``fedaudit report``).

    Args:
        run_dirs: run directories; their attack results are read from each ``attacks/``.
        out: a report file (.html, .md, .pdf) or a folder that receives ``report.<format>``.
        formats: html, md and/or pdf; by default the suffix of ``out``, else html.
        policy_file: YAML limits to judge every run against (docs/audit.md).
        overwrite: replace an existing report and its summaries at ``out``.

    Returns:
        What was written, and the policy's checks and overall verdict (PASS, FAIL or INCONCLUSIVE).

    Raises:
        ReportError: bad input, raised before anything is written.
        TamperedRunError: a run whose files fedaudit did not write cannot even be laid out (exit code 1).
    """
    chosen = tuple(f.lower() for f in formats)
    output_paths(out, chosen, overwrite=overwrite)
    policy = load_policy(policy_file) if policy_file is not None else None
    runs = collect_runs(list(run_dirs))
    try:
        return write_report(runs, out, chosen, policy)
    except UserError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        tampered = next((run for run in runs if run.integrity), None)
        if tampered is None:
            raise
        raise TamperedRunError(tampered.path, tampered.integrity, exc) from exc
