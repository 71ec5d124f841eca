"""The house has no import circles: a module's imports (at the top or inside a function,
but not those only for type checking) never lead back to it. Circles are what made the
heat2d loop a fork and parallelize reach back into train/."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """paratrain modules ``path`` imports, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
            for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[:len(base) - node.level + 1] if node.level else []
            root = ".".join(base + ([node.module] if node.module else []))
            found.add(root)
            found |= {f"{root}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in SRC.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(path, name, modules) for name, path in paths.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_circle_among_api_parallelize_train_and_the_tasks():
    watched = ("paratrain.api", "paratrain.parallelize", "paratrain.train")
    found = [c for c in circles(graph()) if any(m.startswith(watched) for m in c)]
    assert not found, found


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_its_own_files_name_a_task():
    """A task is a plug-in: its name appears in its own files (train/task_NAME.py and its
    settings, train/NAME.py) and nowhere else in the library, so a third task is a new file,
    not edits across the house."""
    own = {SRC / "paratrain" / "train" / "task_heat2d.py", SRC / "paratrain" / "train" / "heat2d.py"}
    named = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
             if p not in own and "heat2d" in p.read_text().lower()]
    assert not named, f"these name the heat2d task outside its files: {named}"
