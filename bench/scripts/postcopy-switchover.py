"""Item 2 of issue 18: what the destination pays at a sparse-ram postcopy switchover.

An 8 GiB guest using 256 MiB migrates in postcopy, switched over early.
Records the downtime and the destination's Rss / AnonHugePages right after
the switchover and at the end, for host THP always/never and
use_zero_page 1/0.  Usage: python bench/scripts/postcopy-switchover.py LABEL OUT.json (as root:
it changes the host THP settings for the run and restores madvise / 1)
"""

import json
import sys
import time
from pathlib import Path

from thinvm.guest import workload
from thinvm.units import GiB, MiB
from thinvm.vm import migrate
from thinvm.vm.machine import VM, VMConfig

THP = Path("/sys/kernel/mm/transparent_hugepage")


def smaps(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def one(label: str, thp: str, zero_page: str) -> dict[str, object]:
    (THP / "enabled").write_text(thp)
    (THP / "use_zero_page").write_text(zero_page)
    config = VMConfig(name="pc-switch", build="patched", memory=8 * GiB)
    caps = {"sparse-ram": True, "postcopy-ram": True}
    with VM(config) as src:
        src.start()
        workload.pattern_write(src.agent, 256 * MiB, seed=5)
        with VM(config, incoming=True) as dst:
            dst.start()
            migrate.set_capabilities(dst, caps)
            uri = migrate.start_incoming(dst, migrate.free_port())
            migrate.set_capabilities(src, caps)
            migrate.set_parameters(
                src, {"max-bandwidth": 64 * MiB, "max-postcopy-bandwidth": 64 * MiB}
            )
            src.qmp("migrate", uri=uri)
            time.sleep(0.5)
            # The destination's main loop answers only once it has applied
            # the switchover package and resumed the guest.
            t0 = time.monotonic()
            src.qmp("migrate-start-postcopy")
            while dst.qmp("query-status")["status"] != "running":
                time.sleep(0.001)
            switch_ms = (time.monotonic() - t0) * 1000
            assert dst.pid is not None
            after_switch = smaps(dst.pid)
            info = migrate.wait_migration(src, 600)
            assert info["status"] == "completed", info
            end = smaps(dst.pid)
            ok = workload.pattern_verify(dst.agent, seed=5).ok
            return {
                "label": label,
                "thp": thp,
                "use_zero_page": int(zero_page),
                "switch_ms": round(switch_ms, 1),
                "src_downtime_ms": info.get("downtime"),
                "total_ms": info.get("total-time"),
                "postcopy_bytes": info["ram"].get("postcopy-bytes"),
                "sparse_skipped": info["ram"].get("sparse-skipped"),
                "dst_rss_after_switch": after_switch["Rss"],
                "dst_anon_huge_after_switch": after_switch["AnonHugePages"],
                "dst_rss_end": end["Rss"],
                "dst_anon_huge_end": end["AnonHugePages"],
                "pattern_ok": ok,
            }


def main() -> None:
    label, out = sys.argv[1], Path(sys.argv[2])
    rows = []
    try:
        for thp in ("always", "never"):
            for zp in ("1", "0"):
                row = one(label, thp, zp)
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        (THP / "enabled").write_text("madvise")
        (THP / "use_zero_page").write_text("1")
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
