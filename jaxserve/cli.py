"""The `jaxserve` command line: a thin dispatcher over library functions.

Each subcommand lives in `jaxserve/commands/<name>.py` and exposes
`add_arguments(parser)` and `run(args) -> int`. Command modules import heavy
libraries (JAX, Ray, gRPC) inside `run`, so `jaxserve plan --help` stays fast
and the planner never loads JAX.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("jaxserve.commands.serve", "run the gRPC and OpenAI-compatible HTTP servers for a deployment"),
    "generate": ("jaxserve.commands.generate", "generate tokens offline for one prompt"),
    "plan": ("jaxserve.commands.plan", "search the per-phase parallelism that maximises per-device goodput"),
    "simulate": ("jaxserve.commands.simulate", "simulate a deployment over a workload"),
    "profile": ("jaxserve.commands.profile", "fit latency-model coefficients on this machine"),
    "bench": ("jaxserve.commands.bench", "drive a running server with a workload and measure SLO attainment"),
    "pull": ("jaxserve.commands.pull", "fetch a registered model (e.g. smollm2-135m-instruct) into the model cache"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; with `only`, that one's arguments alone (the others are listed by name:
    `jaxserve serve` does not import the planner's argument modules to start)."""
    parser = argparse.ArgumentParser(prog="jaxserve", description="Disaggregated LLM serving on JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=help_text, description=help_text)
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            continue  # command not built yet
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(only=words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(words)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
