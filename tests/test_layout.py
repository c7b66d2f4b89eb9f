"""The house's shape: floors (griffin <- training <- inference <- benchmarks), no import circles, every command's
``--help`` answering at once, and a README a newcomer reads in minutes. The checks a reviewer repeats with
``python -m pytest -q tests/test_layout.py``."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_module

FLOORS = {"griffin": 1, "training": 2, "inference": 3, "benchmarks": 4}  # a folder imports only its floor or below


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files() -> list[Path]:
    """The Python files of the four folders (``benchmarks/results`` holds scripts kept as they ran: not the house)."""
    return [p for folder in FLOORS for p in sorted((ROOT / folder).rglob("*.py"))
            if "results" not in p.relative_to(ROOT).parts]


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(path: Path, runtime_only: bool = False) -> set[str]:
    """The project modules ``path`` imports anywhere in it (functions included); relative imports resolved.
    runtime_only leaves out imports under ``if TYPE_CHECKING:`` (they run only for type checkers)."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = module_name(path).split(".") if path.name == "__init__.py" else module_name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if runtime_only and _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import module`
    known = {module_name(p) for p in project_files()}
    return {name for name in found if name in known and name != module_name(path)}


def import_graph(runtime_only: bool = False) -> dict[str, set[str]]:
    return {module_name(p): imports(p, runtime_only) for p in project_files()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_circle_finder_finds_a_circle_and_nothing_else():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_folder_imports_a_folder_above_it():
    upward = sorted(f"{module} -> {name}" for module, names in import_graph().items() for name in names
                    if FLOORS[name.split(".")[0]] > FLOORS[module.split(".")[0]])
    assert upward == []


def test_no_import_circle_between_folders_or_outside_griffin():
    graph = import_graph(runtime_only=True)
    folders: dict[str, set[str]] = {}
    for module, names in graph.items():
        folders.setdefault(module.split(".")[0], set()).update(n.split(".")[0] for n in names)
    assert circles({folder: names - {folder} for folder, names in folders.items()}) == []
    outside = {m: names for m, names in graph.items() if not m.startswith("griffin")}
    assert circles(outside) == []


def test_no_import_circle_inside_griffin():
    graph = import_graph(runtime_only=True)
    assert circles({m: {n for n in names if n.startswith("griffin")} for m, names in graph.items()
                    if m.startswith("griffin")}) == []


def test_the_tuner_and_the_drafters_set_no_generator_fields():
    """The tuner drives the decode loop through its public function: it assigns nothing on a generator and reads
    none of its private parts."""
    for name in ("autotune", "drafters", "draft_lm", "decode", "adapt"):
        tree = ast.parse((ROOT / "griffin" / f"{name}.py").read_text())
        assigned = [ast.unparse(t) for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
        private = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                   and ast.unparse(node.value) == "gen" and node.attr.startswith("_")]
        assert not [a for a in assigned if a.startswith("gen.")] and not private, (name, assigned, private)

def commands() -> list[str]:
    """Every ``python -m`` command of the project: what the argument parsers name themselves (``prog``)."""
    return sorted({name for p in project_files() for name in re.findall(r'prog="python -m ([\w.]+)"', p.read_text())})


HELP_WITHOUT_TORCH = """
import contextlib, io, runpy, sys, time
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    out = io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            assert exit_.code == 0, (module, exit_.code)
    seconds = time.perf_counter() - start
    assert "usage: python -m " + module in out.getvalue(), module
    heavy = sorted(m for m in ("torch", "transformers", "safetensors.torch", "accelerate") if m in sys.modules)
    print(module, heavy, "fast" if seconds < 1.0 else f"{seconds:.2f} s")
"""


def test_every_command_answers_help_at_once_before_loading_torch():
    """--help (and usage errors) answer in well under a second: nothing heavy is imported before parsing."""
    names = commands()
    assert {"inference.demo", "inference.speed", "training.train", "benchmarks.ablation"} <= set(names)
    res = run_module("-c", HELP_WITHOUT_TORCH, *names, launcher=[sys.executable])
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"{module} [] fast" for module in names]



def test_the_readme_is_short_and_names_only_commands_that_exist():
    readme = (ROOT / "README.md").read_text()
    assert len(readme) <= 10_000
    named = set(re.findall(r"python -m ((?:griffin|training|inference|benchmarks)\.\w+)", readme))
    assert {"inference.demo", "inference.chat", "inference.speed", "training.build_features", "training.train",
            "training.export"} <= named
    assert named <= set(commands())


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md", "docs/usage.md", "docs/training.md",
                                  "docs/gpu.md", "docs/draft-lms.md", "docs/design.md"])
def test_every_link_of_the_docs_names_a_committed_file(page):
    text = (ROOT / page).read_text()
    links = re.findall(r"\]\(((?!https?://|#)[^)#\s]+)", text)
    assert links or page == "docs/design.md"
    assert [link for link in links if not ((ROOT / page).parent / link).exists()] == []
