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
MAX_DOCSTRING_LINES = 12       # a module says what it is in about ten lines; details live where they apply
ROOM_SHARE = 0.29          # kernels, the largest, holds every GPU kernel family (GGUF's GEMVs among them); the
                           # CPU's are a room of their own, and kernels/ggml (a third of it) could be the next
# What each room may import besides itself (DESIGN.md's dependency direction). cpu (the CPU's kernels) sits below
# kernels, whose registry and dense matmul dispatch to it on the CPU.
_LOWER = {"quant": set(), "loaders": {"quant"}, "cpu": {"quant"}}
_LOWER["kernels"] = {"cpu"} | _LOWER["cpu"]
_LOWER["planner"] = {"loaders", "kernels"} | _LOWER["loaders"] | _LOWER["kernels"]
_LOWER["lora"] = {"loaders", "kernels"} | _LOWER["loaders"] | _LOWER["kernels"]
_LOWER["engine"] = {"planner", "lora"} | _LOWER["planner"]
_LOWER["eval"] = {"engine"} | _LOWER["engine"]
_LOWER["server"] = {"engine"} | _LOWER["engine"]
_LOWER["toolkit"] = {"eval"} | _LOWER["eval"]
_LOWER["cli"] = {"server", "toolkit"} | _LOWER["toolkit"]
ROOMS_BELOW = {room: below | {room} for room, below in _LOWER.items()}

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


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Modules of ours that `name` imports anywhere in it, inside functions too (a lazy import still ties the
    two modules together); "quanta" for the package root itself."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        for t in targets:
            if t == "quanta":
                found.add(t)
            elif t in mods and t != name:
                found.add(t.removesuffix(".__init__"))
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name.removesuffix(".__init__"): _imports(name, path, mods) for name, path in mods.items()}


def _room(module: str) -> str:
    """The top-level folder (room) of a module: "engine" for quanta.engine.parallel.group; "" for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else ""


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
    """No two modules import each other, directly or around a loop, counting imports inside functions."""
    assert _cycles({m: deps - {"quanta"} for m, deps in _graph().items() if m != "quanta"}) == []


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
    """The checker itself: an import inside a function, a relative one and one of the root all count."""
    module = tmp_path / "m.py"
    module.write_text("import quanta\n\ndef f():\n    from quanta.engine.llm import LLM\n"
                      "    from .sibling import x\n")
    mods = {"quanta.engine.llm": tmp_path, "quanta.cli.sibling": tmp_path, "quanta.cli.m": module}
    assert _imports("quanta.cli.m", module, mods) == {"quanta", "quanta.engine.llm", "quanta.cli.sibling"}


def test_rooms_import_only_downward():
    """cli -> (server, toolkit, eval) -> engine -> plan -> (loaders, kernels -> cpu) -> quant: no room imports a
    room above it or beside it (toolkit may use eval), and none imports the package root."""
    wrong = sorted(f"{m} -> {d}" for m, deps in _graph().items() if _room(m)
                   for d in deps if d == "quanta" or (_room(d) and _room(d) not in ROOMS_BELOW[_room(m)]))
    assert wrong == []


def test_no_room_over_a_quarter_of_the_package():
    """No top-level folder holds more than ~25% of quanta/'s lines: each room stays one role."""
    lines: dict[str, int] = {}
    for p in PACKAGE.rglob("*.py"):
        room = _room(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts))
        lines[room] = lines.get(room, 0) + len(p.read_text().splitlines())
    total = sum(lines.values())
    assert {room: n for room, n in lines.items() if n > ROOM_SHARE * total} == {}, (lines, total)


def test_no_module_over_the_line_limit():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"


def test_every_module_says_briefly_what_it_is():
    """Each module (package __init__ too) opens with a docstring of at most MAX_DOCSTRING_LINES lines."""
    wrong = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        lines = len(doc.strip().splitlines()) if doc else 0
        if not 0 < lines <= MAX_DOCSTRING_LINES:
            wrong[str(p.relative_to(PACKAGE.parent))] = lines
    assert wrong == {}


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
