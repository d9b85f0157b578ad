"""``python -m train run|distill|fit|original|ablate ...``: the drafter's training pipeline
(``run``: the whole recipe from a config, as ``specd train-drafter``)."""

from __future__ import annotations

import argparse
import sys

from . import ablation, distill, fit, original, pipeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train")
    sub = ap.add_subparsers(dest="cmd", required=True)
    pipeline.add_arguments(sub.add_parser("run", help="the whole recipe from a config"))
    distill.add_arguments(sub.add_parser("distill", help="self-distillation data"))
    fit.add_arguments(sub.add_parser("fit", help="train the EAGLE-3 head"))
    original.add_arguments(sub.add_parser("original", help="ShareGPT's own answers (ablation)"))
    ablation.add_arguments(sub.add_parser("ablate", help="the training tricks' ablations"))
    args = ap.parse_args(argv)
    if args.cmd == "run":
        pipeline.run(args)
    elif args.cmd == "distill":
        distill.run(args)
    elif args.cmd == "fit":
        fit.run(args)
    elif args.cmd == "original":
        original.run(args)
    elif args.cmd == "ablate":
        ablation.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
