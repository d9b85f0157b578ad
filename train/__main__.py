"""``python -m train distill|fit ...``: the drafter's training pipeline."""

from __future__ import annotations

import argparse
import sys

from . import distill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train")
    sub = ap.add_subparsers(dest="cmd", required=True)
    distill.add_arguments(sub.add_parser("distill", help="self-distillation data"))
    args = ap.parse_args(argv)
    if args.cmd == "distill":
        distill.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
