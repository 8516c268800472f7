"""No module of ours reaches itself again through its imports (issue 49: the step loop and the engine each owned the
other, the admission and scheduling drivers imported each other, the vocoder's runner and its export module too).
Every import is read from the source, at module level, inside a function or under ``TYPE_CHECKING`` alike."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` (under ``root``) it imports."""
    names = {".".join(p.relative_to(root).with_suffix("").parts): p for p in root.rglob(f"{package}/**/*.py")}
    names = {n.removesuffix(".__init__"): p for n, p in names.items()}
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                found |= {m for m in (node.module, *(f"{node.module}.{a.name}" for a in node.names)) if m in names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name in names}
        graph[name] = found - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[str]:
    """The modules that reach themselves (a package's ``__init__`` importing its own modules aside)."""
    def reaches(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen
    return sorted(n for n in graph if not n.endswith("__init__") and n in reaches(n))


@pytest.mark.parametrize("root, package, some", [
    (ROOT / "tools", "s3flow_tools", ("s3flow_tools.measure.qos", "s3flow_tools.measure.admission")),
    (ROOT / "python_backend", "s3flow", ("s3flow.engine.step_loop", "s3flow.engine.streaming")),
])
def test_no_module_imports_itself_through_others(root, package, some):
    graph = import_graph(root, package)
    assert all(graph.get(m) for m in some), "the graph was read"
    assert not circles(graph), f"modules that import themselves through others: {circles(graph)}"


def test_a_circle_is_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c"]
