"""`serve --engine NAME`: which engines (and KV connector) the embedded backend serves with.

Light to import (the argument parser reads `ENGINE_BACKENDS` and `engine_name`): each backend imports its engine
when it is chosen.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.runtime.instances import EngineFactory
    from jaxserve.runtime.kv_connectors.base import TransferFactory


@dataclasses.dataclass(frozen=True)
class EngineBackend:
    """What `--engine NAME` serves with on the embedded backend: the engines (`jaxserve/runtime/engines/`), the
    KV transfer into a decode instance's engine (None: the in-process one), and whether the KV pool is sized
    from the memory the loaded weights leave (unless a number was given)."""

    factory: EngineFactory
    transfer: TransferFactory | None = None
    pool_from_memory: bool = False


def _model_backend(model: str, args: argparse.Namespace) -> EngineBackend:
    from jaxserve.runtime.engines.model import model_engine_factory

    factory = model_engine_factory(model, dtype=args.dtype, quantization=args.quantization)
    return EngineBackend(factory, pool_from_memory=True)


def _fake_backend(model: str, args: argparse.Namespace) -> EngineBackend:
    from jaxserve.runtime.engines.fake import fake_engine_factory
    from models.checkpoint import source_config

    return EngineBackend(fake_engine_factory(source_config(model)))


def _timed_backend(model: str, args: argparse.Namespace) -> EngineBackend:
    """The timed engine on `--profile`'s latency model; each pull's link time runs from its start, as the
    simulator charges it (`TimedTransfer`)."""
    from jaxserve.runtime.kv_connectors.timed import TimedTransfer
    from jaxserve.tools.timed_engine import timed_engine_factory
    from models.checkpoint import source_config
    from placement.hardware import get_device
    from placement.latency import LatencyProvider, load_profile

    if args.profile is None:
        raise ValueError("--engine timed needs --profile")
    cfg = source_config(model, "float16")
    prof = load_profile(args.profile)
    latency = LatencyProvider(cfg, get_device(prof.device or "cpu"), prof)
    return EngineBackend(timed_engine_factory(cfg, latency), transfer=TimedTransfer)


ENGINE_BACKENDS: dict[str, Callable[[str, argparse.Namespace], EngineBackend]] = {
    "model": _model_backend,
    "fake": _fake_backend,
    "timed": _timed_backend,
}


def engine_name(value: str) -> str:
    """`--engine`'s value; `opt` (the family-blind engine's old name) is read as `model`."""
    if value == "opt":
        print("warning: --engine opt is deprecated; it is --engine model", file=sys.stderr)
        return "model"
    return value
