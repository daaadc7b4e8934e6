"""Reports: tables, figures, HTML/PDF compliance reports and comparisons."""
