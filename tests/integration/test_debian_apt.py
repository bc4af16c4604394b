"""scripts/debian-apt.sh, the private apt the image builders query, under
the concurrency of a parallel test run."""

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEBIAN_APT = REPO / "scripts" / "debian-apt.sh"


def bookworm_kernels() -> list[str]:
    """The bookworm (not backports) linux-image-amd64 versions one query sees."""
    out = subprocess.run(
        ["bash", str(DEBIAN_APT), "madison", "linux-image-amd64"],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    return [
        line.split("|")[1].strip()
        for line in out.splitlines()
        if "bookworm/main" in line and "Packages" in line
    ]


def test_concurrent_queries_all_see_the_bookworm_kernel() -> None:
    # Each query rewrote the apt configuration in place: one truncating
    # sources.list while another read it left that reader with no suites
    # (4 of 30 here), and a CI run's disk images with no kernel to build.
    with ThreadPoolExecutor(max_workers=24) as pool:
        seen = list(pool.map(lambda _: bookworm_kernels(), range(24)))
    empty = sum(1 for kernels in seen if not kernels)
    assert empty == 0, f"{empty} of {len(seen)} concurrent queries saw no bookworm kernel"
    assert all(kernels == seen[0] for kernels in seen)
