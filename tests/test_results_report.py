"""benchmarks/RESULTS.md stays a current-state report: short, and citing exactly the results it keeps."""
from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
REPORT = BENCHMARKS / "RESULTS.md"
RESULTS = BENCHMARKS / "results"
MAX_LINES = 400
CITATION = re.compile(r"results/([\w.-]+)")


def _cited() -> set[str]:
    return {name.rstrip(".") for name in CITATION.findall(REPORT.read_text(encoding="utf-8"))}


def test_report_is_short():
    """RESULTS.md holds at most 400 lines."""
    lines = REPORT.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"RESULTS.md has {len(lines)} lines (at most {MAX_LINES})"


def test_every_result_is_cited():
    """Every entry directly under benchmarks/results/ is cited in RESULTS.md as results/<name>."""
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in _cited())
    assert not uncited, f"cited by nothing in RESULTS.md: {uncited}"


def test_every_citation_exists():
    """Every results/<name> that RESULTS.md cites exists under benchmarks/results/."""
    missing = sorted(name for name in _cited() if not (RESULTS / name).exists())
    assert not missing, f"cited in RESULTS.md but absent from benchmarks/results/: {missing}"
