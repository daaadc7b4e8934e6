"""Reports: tables, figures, HTML/PDF compliance reports and comparisons."""

from fedaudit.reports.build import build_report
from fedaudit.reports.collect import ReportError
from fedaudit.reports.render import FORMATS, ReportOutcome

__all__ = ["FORMATS", "ReportError", "ReportOutcome", "build_report"]
