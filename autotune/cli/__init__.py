"""Command line: parse -> validated config -> one library call -> exit code. Nothing else.

Each subcommand group lives in its own module with a ``register(subparsers)`` function.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from autotune.credentials import redact
from autotune.errors import AutotuneError

__all__ = ["build_parser", "main"]

_GROUPS = ("_model", "_shape", "_tune", "_bench", "_best", "_cost", "_export", "_report",
           "_watch", "_kernels", "_rollout", "_sync")

EXIT_OK = 0
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from autotune import __version__

    parser = argparse.ArgumentParser(
        prog="autotune",
        description=(
            "Bayesian traffic-shape auto-tuner for vLLM. Fit the shape of the traffic your "
            "endpoint serves, search vLLM engine settings against real servers under that "
            "traffic, and get the fastest configuration that meets your SLOs."
        ),
        epilog="Run 'autotune COMMAND --help' for the options of each command.",
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _GROUPS:
        try:
            module = importlib.import_module(f"autotune.cli.{name}")
        except ModuleNotFoundError as exc:  # a group not built yet must not break the others
            if exc.name != f"autotune.cli.{name}":
                raise
            continue
        module.register(sub)
    return parser


class _RedactingFormatter(logging.Formatter):
    """The handler's own format, with every URL's password replaced by ``***``."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # flags given (they beat --config)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # no password of a store URL in a log line
        handler.setFormatter(_RedactingFormatter(handler.formatter))
    try:
        return int(args.func(args) or EXIT_OK)
    except AutotuneError as exc:
        print(f"autotune: error: {redact(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
