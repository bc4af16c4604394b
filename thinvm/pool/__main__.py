"""`python -m thinvm.pool serve ROOT [--once]`: the worker process the pool spawns."""

import argparse
import os
import sys
from collections.abc import Sequence

from thinvm.errors import ThinvmError
from thinvm.pool.worker import PoolLog, serve


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thinvm.pool")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the pool worker (the daemon, or --once)")
    p.add_argument("root")
    p.add_argument("--once", action="store_true", help="exit when there is nothing to do")
    args = parser.parse_args(argv)
    out = PoolLog(prefix=f"pool [{os.getpid()}]: ")
    try:
        serve(args.root, once=args.once, out=out)
    except ThinvmError as exc:
        print(f"thinvm pool: error: {exc}", file=sys.stderr)
        return 1
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
