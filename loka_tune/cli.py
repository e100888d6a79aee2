"""The ``loka-tune`` command line.

Each subcommand lives in ``loka_tune/commands/<name>.py`` with three things: ``HELP`` (one
line), ``add_arguments(parser)`` and ``run(args) -> int``. Command modules import only
argparse-level things at top level, so ``loka-tune --help`` is fast; heavy work is imported
inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
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
    common = _Parser(add_help=False)  # every command: how much it says on stderr
    talk = common.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only (no progress lines)")
    talk.add_argument("-v", "--verbose", action="store_true", help="debug lines too")
    for name in COMMANDS:
        mod = importlib.import_module(f"loka_tune.commands.{name}")
        p = sub.add_parser(name, help=mod.HELP, description=getattr(mod, "DESCRIPTION", mod.HELP),
                           formatter_class=argparse.RawDescriptionHelpFormatter, parents=[common])
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
    from loka_tune.tuner.log import to_stderr

    # the library only logs (the loka_tune logger): the CLI prints its records as the lines it shows
    to_stderr(logging.WARNING if args.quiet else logging.DEBUG if args.verbose else logging.INFO)
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
