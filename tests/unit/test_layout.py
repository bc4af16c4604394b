"""Package layering: the pool knows VMs only by their leases."""

import ast
from pathlib import Path

import thinvm

PACKAGE = Path(thinvm.__file__).parent


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_pool_never_imports_the_vm_package() -> None:
    """thinvm.vm imports the pool (leases); the other way would be a cycle."""
    for path in sorted((PACKAGE / "pool").glob("*.py")):
        vm = {m for m in imported_modules(path) if m == "thinvm.vm" or m.startswith("thinvm.vm.")}
        assert not vm, f"{path.name} imports {sorted(vm)}: start VMs in thinvm.vm.pooled"


def test_detached_vm_lifecycle_has_one_home() -> None:
    """Run directories, listing and attaching belong to thinvm.vm.registry."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "registry.py" and path.parent.name == "vm":
            continue
        text = path.read_text()
        assert 'glob("*/state.json")' not in text, f"{path} lists detached VMs itself"
        assert "VM.attach(run_dir()" not in text, f"{path} attaches by run directory itself"
