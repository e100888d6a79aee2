"""The ``loka-tune`` command line.

Each subcommand lives in ``loka_tune/commands/<name>.py`` with three things: ``HELP`` (one
line), ``add_arguments(parser)`` and ``run(args) -> int``. Command modules import only
argparse-level things at top level, so ``loka-tune --help`` is fast; heavy work is imported
inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn, Sequence

from loka_tune.errors import LokaError

COMMANDS = ("train", "probe", "tune", "export", "report")


class _Parser(argparse.ArgumentParser):
    """A usage error is one line (what is wrong, where the help is), not the usage text first."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    from loka_tune.version import __version__

    parser = _Parser(
        prog="loka-tune",
        description=(
            "Autotune FP8 precision configs for recommendation models (LoKA): probe where low"
            " precision is safe and fast, search per-layer GEMM choices and model Mods under a"
            " relative-log-loss budget, and export the fastest feasible config."
        ),
    )
    parser.add_argument("--version", action="version", version=f"loka-tune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"loka_tune.commands.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)  # a command that re-launches itself (train --nproc)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except LokaError as e:
        print(f"loka-tune {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"loka-tune {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
