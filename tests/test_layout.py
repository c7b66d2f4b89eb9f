"""The package's import graph: modules that need each other's behaviour call public functions, in one direction."""

from __future__ import annotations

import ast

from tests.conftest import ROOT

# the lead's draft-head work (issue 33) removes the last circle: official.py returns config and state, draft.py builds
KNOWN = {frozenset({"draft", "official"})}


def griffin_imports() -> dict[str, set[str]]:
    """module -> the griffin modules it imports anywhere in its file (function-level imports too)."""
    graph = {}
    for path in (ROOT / "griffin").glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[path.stem] = imported
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Pairs of modules that reach each other."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    return {frozenset({a, b}) for a in graph for b in graph[a] if a != b and a in reach(b)}


def test_no_import_circles_in_griffin():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("ab"), frozenset("bc"),
                                                                          frozenset("ca")}
    graph = griffin_imports()
    assert {"decode", "autotune", "generator", "drafters"} <= set(graph) and "generator" not in graph["autotune"]
    assert circles(graph) <= KNOWN, circles(graph) - KNOWN


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
