"""The thinvm package (packaging/build-debs.sh) leaves out thinvm/bench and
thinvm/testing: what it does ship must import and run without them."""

import shutil
import subprocess
import sys
from pathlib import Path

import qemu.qmp

from thinvm.paths import REPO

LEFT_OUT = ("bench", "testing")


def packaged_tree(tmp_path: Path) -> Path:
    """thinvm's sources as the package installs them (its find expression)."""
    find = ["find", "thinvm", "(", "-path", "thinvm/bench", "-o", "-path", "thinvm/testing", ")"]
    find += ["-prune", "-o", "(", "-name", "*.py", "-o", "-name", "py.typed", ")", "-print"]
    files = subprocess.run(find, cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in files.split():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def run(tree: Path, code: str) -> subprocess.CompletedProcess[str]:
    """Run `code` in a Python that sees `tree`'s thinvm and qemu.qmp, as
    the package's does: -I -S leave out the checkout (the current
    directory, PYTHONPATH, the venv's editable install of thinvm)."""
    qmp_site = Path(qemu.qmp.__file__).parents[2]
    prelude = f"import sys; sys.path[:0] = [{str(tree)!r}, {str(qmp_site)!r}]; "
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", prelude + code],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_package_find_expression_is_build_debs(tmp_path: Path) -> None:
    script = (REPO / "packaging/build-debs.sh").read_text()
    assert "-path thinvm/bench -o -path thinvm/testing \\) -prune" in script
    tree = packaged_tree(tmp_path)
    assert (tree / "thinvm/vm/machine.py").is_file()
    assert not any((tree / "thinvm" / d).exists() for d in LEFT_OUT)


def test_every_packaged_module_imports_without_them(tmp_path: Path) -> None:
    tree = packaged_tree(tmp_path)
    names = [
        ".".join(p.relative_to(tree).with_suffix("").parts).removesuffix(".__init__")
        for p in sorted((tree / "thinvm").rglob("*.py"))
        if p.name != "__main__.py"
    ]
    proc = run(tree, f"import importlib; [importlib.import_module(n) for n in {names!r}]")
    assert proc.returncode == 0, proc.stderr


def test_thinvm_bench_says_where_the_benchmarks_are(tmp_path: Path) -> None:
    tree = packaged_tree(tmp_path)
    main = "from thinvm.cli import main; sys.exit(main({}))"
    assert run(tree, main.format(["--help"])).returncode == 0
    proc = run(tree, main.format(["bench", "inflate"]))
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "source tree" in proc.stderr, proc.stderr
    # thinvm up in a packaged thinvm starts thinvm's own VMs.
    proc = run(tree, "from thinvm.vm import registry, machine; "
                     "assert registry.vm_class() is machine.VM")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
