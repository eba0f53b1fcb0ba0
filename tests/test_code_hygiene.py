"""The package reads as a design: no import cycles, no oversized modules, no lab notebook.

Figures, dates and the story of how a number was found belong in benchmarks/RESULTS.md and commit
messages; quanta/ states rules and their reasons.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "quanta"
MAX_LINES = 500

# A date, a work-log label ("third session", "run c", "issue 4"), a results file, or a timing figure.
NOTEBOOK = re.compile(
    r"20\d\d-\d\d-\d\d"
    r"|\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(st|nd|rd|th)) session\b"
    r"|\bruns? [a-h]\b(?! *=)"
    r"|\bissue \d+\b"
    r"|results/[\w.-]+\.json|RESULTS\.md"
    r"|\d(\.\d+)? ?(us|µs|ms)\b"
    r"|\d(\.\d+)? ?tok/s"
    r"|\d(\.\d+)? ?(TB|GB)/s"
    r"|\d(\.\d+)? ?TFLOP"
    r"|\d(\.\d+)?x (faster|slower)|\d(\.\d+)?× ",
    re.IGNORECASE)


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        mods[".".join(rel.parts)] = path
    return mods


def _module_level_imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of ours that `name` imports at module level (imports inside functions are lazy)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        found |= {t for t in targets if t in mods and t != name and not t.endswith("__init__")}
    return found


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    """The checker itself: a planted two-module cycle is found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    mods = _modules()
    edges = {name: _module_level_imports(name, path, mods) for name, path in mods.items()
             if path.name != "__init__.py"}
    assert _cycles(edges) == []


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_notebook_pattern_catches_what_it_should():
    for text in ("measured 2026-11-25", "the third session", "run c of the suite", "27.4 us against 30.4",
                 "see RESULTS.md", "results/kernels-h100.json", "400 tok/s", "3.02 TB/s", "1.4x faster"):
        assert NOTEBOOK.search(text), text
    for text in ("BLOCK_M = 64", "M = 1..16 take the GEMV", "split-K over 4 K tiles", "runs = 3"):
        assert not NOTEBOOK.search(text), text


def test_no_dates_work_log_labels_or_timings_in_the_package():
    hits = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()[:100]}"
            for p in sorted(PACKAGE.rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if NOTEBOOK.search(line)]
    assert hits == [], "\n".join(hits)
