"""Reports: tables, figures, HTML/PDF compliance reports and comparisons."""

from reports.build import build_report
from reports.collect import ReportError
from reports.render import FORMATS, ReportOutcome

__all__ = ["FORMATS", "ReportError", "ReportOutcome", "build_report"]
