"""thinvm's modules import one another without a cycle, and thinvm's
own code never needs the test suite's (thinvm.testing).

Module-level imports only (those under `if TYPE_CHECKING:` too: a cycle
they hide is one all the same; not those under `if __name__ ==
"__main__":`); imports inside a function are where a module reaches,
late and on purpose, for one that comes after it.
"""

import ast
from pathlib import Path

from thinvm.paths import REPO

PACKAGE = REPO / "thinvm"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """The module's statements, and those in its top-level if/try blocks."""
    found: list[ast.stmt] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        found.append(node)
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue  # run as a script, not on import
        if isinstance(node, ast.If | ast.Try):
            todo += [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            todo += [s for h in getattr(node, "handlers", []) for s in h.body]
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The thinvm modules `name` imports at module level."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in _top_level(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, set(known)) for name, path in known.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in `edges`, as the modules along it, or None."""
    state: dict[str, str] = {}  # "open" on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_scan_finds_a_cycle() -> None:
    """The control: a cycle the scan must report."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_scan_sees_thinvms_imports() -> None:
    edges = graph()
    assert "thinvm.vm.machine" in edges["thinvm.vm.registry"]
    assert "thinvm.vm.machine" in edges["thinvm.testing.keptboot"]


def test_thinvm_has_no_import_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_thinvm_imports_nothing_of_the_test_suites() -> None:
    """Only thinvm.testing imports thinvm.testing: the thinvm package
    leaves it out (packaging/build-debs.sh)."""
    users = {
        name: sorted(m for m in deps if m.startswith("thinvm.testing"))
        for name, deps in graph().items()
        if not name.startswith("thinvm.testing")
    }
    assert {name: deps for name, deps in users.items() if deps} == {}


def package(module: str) -> str:
    """thinvm.vm.machine -> vm; thinvm.cli -> cli."""
    return module.split(".")[1] if module.count(".") else module


def test_no_cycle_between_packages() -> None:
    """Layers, not just modules: guest speaks to the guest and knows
    nothing of a VM (vm uses guest, never the other way round), and so on
    for every pair of thinvm's subpackages."""
    edges: dict[str, set[str]] = {}
    for name, deps in graph().items():
        edges.setdefault(package(name), set()).update(
            package(dep) for dep in deps if package(dep) != package(name)
        )
    cycle = find_cycle(edges)
    assert cycle is None, "package cycle: " + " -> ".join(cycle or [])
