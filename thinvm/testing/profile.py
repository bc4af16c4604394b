"""How the test suite's guests boot: a GuestProfile, read from
THINVM_TEST_PROFILE here and nowhere else.

Users' guests boot the image's bzImage with the image's own kernel
arguments, as the benchmarks' records were taken.  Under TCG the suite
pays for every guest boot in CPU, some hundred times a run, so its guests
(tests/conftest.py) boot:

- through PVH (`pvh`): the vmlinux inside the bzImage, with no xz
  decompressor (thinvm.guest.pvh);
- with kernel arguments before their own (`append`), which skip work no
  test is about (tests/conftest.py says which and what each saves);
- from a kept boot where one can be (`kept_boots`, a directory):
  thinvm.testing.keptboot.

The suite sets the variable, so the thinvm commands it runs (`thinvm up`
in a subprocess) boot the same guests: thinvm.vm.registry asks this
package for the class of the VMs it starts.  The value is JSON, as
GuestProfile.to_env writes it: {"pvh": true, "append": "...",
"kept_boots": "/dir"}; keys left out take the user's default.
"""

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from thinvm.errors import ThinvmError
from thinvm.fleet.domain import DomainSpec
from thinvm.guest import pvh

ENV = "THINVM_TEST_PROFILE"


@dataclass(frozen=True)
class GuestProfile:
    """How a guest boots; the defaults are how users' guests boot."""

    pvh: bool = False
    append: str = ""  # kernel arguments before the guest's own (which win)
    kept_boots: Path | None = None  # None: every guest boots

    def kernel(self, bzimage: Path) -> Path:
        """What to boot of the image's kernel `bzimage`."""
        return pvh.kernel_for(bzimage) if self.pvh else bzimage

    def cmdline(self, own: str) -> str:
        """A guest's kernel command line: `append`, then its own."""
        return " ".join(a for a in (self.append, own) if a)

    def domain(self, spec: DomainSpec) -> DomainSpec:
        """A libvirt domain booted with this profile (thinvm.fleet.guest.spec_for
        gives users' domains: the bzImage, the image's own arguments)."""
        return replace(spec, kernel=self.kernel(spec.kernel), cmdline=self.cmdline(spec.cmdline))

    def to_env(self) -> str:
        kept = str(self.kept_boots) if self.kept_boots is not None else None
        return json.dumps({"pvh": self.pvh, "append": self.append, "kept_boots": kept})

    @classmethod
    def from_env(cls, text: str) -> "GuestProfile":
        """The profile of an environment value (module doc)."""
        try:
            data: Any = json.loads(text)
            if not isinstance(data, dict) or set(data) - {"pvh", "append", "kept_boots"}:
                raise ValueError("want an object with pvh, append and kept_boots")
            kept = data.get("kept_boots")
            return cls(
                pvh=_typed(data.get("pvh", False), bool),
                append=_typed(data.get("append", ""), str),
                kept_boots=Path(_typed(kept, str)) if kept else None,
            )
        except ValueError as exc:
            raise ThinvmError(
                f"{ENV}={text!r} is not a guest profile ({exc}): unset it, or see "
                "thinvm/testing/profile.py"
            ) from exc


def _typed(value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{value!r} is not a {kind.__name__}")
    return value


def current() -> GuestProfile | None:
    """The test profile this process runs under; None: none (a user's)."""
    text = os.environ.get(ENV)
    return GuestProfile.from_env(text) if text else None
