"""No function over 80 lines outside the QEMU patches (issue 49): the
control plane and the tests (Python), the guest driver and agent (C)."""

import ast
from pathlib import Path

from thinvm.paths import REPO

LIMIT = 80


def python_functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def c_functions(path: Path) -> list[tuple[str, int]]:
    """Kernel style: a function's body opens and closes with a brace in
    column 0, the line before the opening one is its declaration."""
    found, start = [], None
    lines = path.read_text().split("\n")
    for i, line in enumerate(lines):
        if line == "{":
            start = i
        elif line == "}" and start is not None:
            found.append((lines[start - 1].strip(), i - start + 2))
            start = None
    return found


def test_no_function_is_longer_than_80_lines() -> None:
    long = [
        f"{path.relative_to(REPO)}: {name} ({lines} lines)"
        for path in sorted([*(REPO / "thinvm").rglob("*.py"), *(REPO / "tests").rglob("*.py")])
        for name, lines in python_functions(path)
        if lines > LIMIT
    ]
    long += [
        f"{path.relative_to(REPO)}: {name} ({lines} lines)"
        for path in sorted((REPO / "guest").rglob("*.c"))
        for name, lines in c_functions(path)
        if lines > LIMIT
    ]
    assert not long, "\n".join(long)


def test_the_c_scan_finds_functions() -> None:
    # A scan that found nothing would pass vacuously.
    assert len(c_functions(REPO / "guest/agent/reclaim.c")) > 10
