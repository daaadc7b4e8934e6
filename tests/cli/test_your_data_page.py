"""docs/your-data.md's walk-throughs, run as a user runs them: every shell block of the page, in order, in a fresh
folder with this environment's ``fedaudit`` on the PATH, and every Python block whose first line names a file saved
under that name first. The page and this test cannot drift apart. Each ``fedaudit`` command is a process of its own,
forked from the session's zygote of fedaudit (its imports done once) through the zygote's ``fedaudit`` shim."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from zygote import Zygote

PAGE = Path(__file__).resolve().parents[2] / "docs" / "your-data.md"


def blocks() -> list[tuple[str, str]]:
    """The page's fenced blocks as (language, body), in order."""
    text = PAGE.read_text(encoding="utf-8")
    return re.findall(r"^```(\w+)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_every_walkthrough_of_the_page_runs_as_written(tmp_path: Path, fedaudit_zygote: Zygote) -> None:
    found = blocks()
    assert [language for language, _ in found] == ["bash", "bash", "python", "bash"]
    env = {
        **os.environ,
        "PATH": os.pathsep.join(
            [str(fedaudit_zygote.bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")]
        ),
        "OMP_NUM_THREADS": "1",
    }
    for language, body in found:
        if language == "python":
            name = re.match(r"# ([\w./]+\.py)\n", body)
            assert name, "a Python block names the file it is saved as on its first line"
            (tmp_path / name.group(1)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name.group(1)).write_text(body, encoding="utf-8")
            continue
        done = subprocess.run(
            ["bash", "-e", "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, f"{body}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for report in ("mine-report", "sites-report"):
        assert "Privacy guarantee" in (tmp_path / report / "report.html").read_text(encoding="utf-8")
    sites = (tmp_path / "sites-report" / "report.html").read_text(encoding="utf-8")
    assert "each from its own site&#39;s file" in sites or "each from its own site's file" in sites
    for run in ("runs/mine", "runs/sites", "runs/tiny"):
        assert sorted(p.name for p in (tmp_path / run / "attacks").iterdir()), run
