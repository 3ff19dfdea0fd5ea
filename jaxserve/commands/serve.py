"""`jaxserve serve`: run a deployment behind the gRPC and OpenAI-compatible HTTP servers.

    jaxserve serve                                   # the embedded default: default_model(), DEFAULT_DEPLOYMENT
    jaxserve serve --deployment disagg:prefill=tp2,decode=tp1 --model DIR|PRESET
    jaxserve serve --plan plan.json --grpc-port 0 --http-port 0 --api-key KEY

Logs one line per instance (role, tp x pp, devices), warms the deployment up
(`controller.warmup()`: compiles before the first client; `--no-warmup` skips it), logs
the time to ready, then prints `ready grpc=HOST:PORT http=HOST:PORT` on stdout once both
servers accept requests. JAX's persistent compilation cache (`--compile-cache`, default
under the user's cache directory) makes a restart's warm-up fast.
SIGINT/SIGTERM drain in-flight requests and stop.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.commands.common import DEFAULT_DEPLOYMENT, default_model, ensure_host_devices, parse_cpus, pin_to_cpus
from jaxserve.limits import DEFAULT_LIMITS, ServingLimits

if TYPE_CHECKING:
    from jaxserve.plan import DeploymentPlan
    from jaxserve.runtime.instances import EngineFactory

API_KEY_ENV = "JAXSERVE_API_KEY"
COMPILE_CACHE_MIN_COMPILE_S = 0.1  # compilations faster than this are not worth a cache file


def default_compile_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/jaxserve/xla` (default `~/.cache/jaxserve/xla`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxserve" / "xla"


def compile_cache_dir(value: str | None) -> Path | None:
    """The `--compile-cache` value as a directory; None when it is `off`."""
    if value is None:
        return default_compile_cache_dir()
    if value.lower() == "off":
        return None
    return Path(value).expanduser()


def enable_compile_cache(directory: Path, min_compile_time_s: float = COMPILE_CACHE_MIN_COMPILE_S) -> None:
    """Turn on JAX's persistent compilation cache in `directory` (the engine's switch; imports JAX)."""
    from jaxserve.runtime.opt_engine import enable_compilation_cache

    enable_compilation_cache(directory, min_compile_time_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--plan", help="a plan file written by `jaxserve plan`")
    where.add_argument(
        "--deployment", help=f"deployment spec, e.g. disagg:prefill=tp1,decode=tp1 (default {DEFAULT_DEPLOYMENT})"
    )
    parser.add_argument(
        "--model", help="checkpoint directory or preset name (default: the plan's, else the shipped tiny model)"
    )
    parser.add_argument("--served-model-name", help="the model name clients see (default: the model config's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--http-port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--api-key", default=None, help=f"require `Authorization: Bearer KEY` (default: env {API_KEY_ENV}, else none)"
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve gRPC and HTTP over TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20, help="HTTP body / gRPC message limit")
    parser.add_argument(
        "--engine",
        choices=["opt", "fake", "timed"],
        default="opt",
        help="fake: the hand-computable test engine (no model); timed: sleeps --profile's step times (no model)",
    )
    parser.add_argument(
        "--profile", default=None, help="--engine timed: the latency profile (built-in name or JSON file) it sleeps"
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up (compilation) before the ready line")
    parser.add_argument(
        "--warmup-buckets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm-up compiles every padded shape the limits allow, not only one request's (default: on)",
    )
    parser.add_argument(
        "--compile-cache",
        metavar="DIR",
        default=None,
        help="JAX persistent compilation cache directory (default: $XDG_CACHE_HOME/jaxserve/xla); 'off' disables it",
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get at shutdown")
    ray_group = parser.add_argument_group("backend")
    ray_group.add_argument(
        "--backend",
        choices=["embedded", "ray"],
        default="embedded",
        help="embedded: instances as threads in this process; ray: every instance a Ray actor (disagg plans)",
    )
    ray_group.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    ray_group.add_argument(
        "--kv-transfer",
        choices=["object_store", "jax"],
        default="object_store",
        help="ray backend: how decode actors pull KV (jax: jax.experimental.transfer)",
    )
    limits = parser.add_argument_group("runtime limits")
    # Defaults: the plan's recorded limits with --plan, else jaxserve/limits.py (what plan/simulate assume).
    limits.add_argument("--num-kv-blocks", type=int, default=None, help="paged KV blocks per decode instance")
    limits.add_argument("--block-size", type=int, default=None)
    limits.add_argument("--max-decode-batch-size", type=int, default=None)
    limits.add_argument("--max-batch-tokens", type=int, default=None, help="engine token cap of one prefill step")
    limits.add_argument("--max-queued-requests", type=int, default=256, help="admission control bound")
    limits.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted")
    cache = parser.add_argument_group("prefix caching (docs/prefix_caching.md)")
    cache.add_argument(
        "--prefix-caching",
        action="store_true",
        help="keep KV blocks content-addressed on every instance, compute and pull only uncached prompt parts, "
        "route by cached prefix (embedded backend only)",
    )
    cache.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=0,
        help="conditional disaggregation: a prompt whose part uncached on its decode instance is shorter than "
        "this is prefilled there, with no transfer (0: never)",
    )
    cache.add_argument(
        "--prefill-kv-blocks",
        type=int,
        default=None,
        help="a caching prefill instance's pool (default --num-kv-blocks)",
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="run on these CPUs only, e.g. 0 or 0-3 (CPU hosts: keeps a load generator off the serving cores)",
    )


def _timed_engine_factory(model: str, profile: str | None) -> EngineFactory:
    from jaxserve.testing.timed_engine import timed_engine_factory
    from models.config import PRESETS, OPTConfig, get_config
    from placement.hardware import get_device
    from placement.latency import LatencyProvider, load_profile

    if profile is None:
        raise ValueError("--engine timed needs --profile")
    cfg = get_config(model, "float16") if model in PRESETS else OPTConfig.from_hf_config(model)
    prof = load_profile(profile)
    latency = LatencyProvider(cfg, get_device(prof.device or "cpu"), prof)
    return timed_engine_factory(cfg, latency)


def serving_limits(args: argparse.Namespace, plan: DeploymentPlan) -> ServingLimits:
    """The limits to serve with: each flag given on the command line, else the plan's, else the defaults."""
    base = plan.limits or DEFAULT_LIMITS
    flags = {
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "max_decode_batch": args.max_decode_batch_size,
        "max_batch_tokens": args.max_batch_tokens,
    }
    return dataclasses.replace(base, **{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    import logging

    from jaxserve.plan import DeploymentPlan, PlanError, parse_deployment

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("jaxserve.serve")
    try:
        if args.plan:
            plan = DeploymentPlan.from_json(Path(args.plan).read_text())
        else:
            plan = parse_deployment(args.deployment or DEFAULT_DEPLOYMENT)
        plan = plan.assign_devices()
    except (PlanError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.engine == "timed" and args.backend == "ray":
        print("error: --engine timed runs with the embedded backend only", file=sys.stderr)
        return 2
    if (args.tls_cert is None) != (args.tls_key is None):
        print("error: --tls-cert and --tls-key go together", file=sys.stderr)
        return 2
    if args.cpus is not None:
        try:
            pin_to_cpus(parse_cpus(args.cpus))
        except ValueError as e:
            print(f"error: --cpus: {e}", file=sys.stderr)
            return 2
    highest = max(d for inst in plan.instances for d in (inst.devices or (0,)))
    ensure_host_devices(highest + 1)
    cache_dir = compile_cache_dir(args.compile_cache)
    if cache_dir is not None:
        try:
            enable_compile_cache(cache_dir)
        except OSError as e:
            print(f"error: --compile-cache: {e}", file=sys.stderr)
            return 2
        log.info("compilation cache: %s", cache_dir)

    from jaxserve.runtime.controller import Controller, ControllerConfig
    from jaxserve.runtime.instances import place
    from jaxserve.scheduling import PrefixPolicy
    from jaxserve.serving.server import ServerConfig, run_until_signal

    model = args.model or plan.model or default_model()
    limits = serving_limits(args, plan)
    config = ControllerConfig(
        block_size=limits.block_size,
        num_kv_blocks=limits.num_kv_blocks or DEFAULT_LIMITS.num_kv_blocks or 1,
        max_decode_batch_size=limits.max_decode_batch,
        max_batch_tokens=limits.max_batch_tokens,
        prefill_buffer_capacity=limits.prefill_buffer_slots,
        max_queued_requests=args.max_queued_requests,
        max_tokens_limit=args.max_tokens_limit,
        drain_timeout_s=args.drain_timeout,
        warmup_buckets=args.warmup_buckets,
        prefix_caching=args.prefix_caching,
        prefill_num_kv_blocks=args.prefill_kv_blocks,
        prefix_policy=PrefixPolicy(local_prefill_tokens=args.local_prefill_tokens),
    )
    try:
        engine_factory: EngineFactory | None = None
        if args.engine == "fake":
            from jaxserve.testing.fake_engine import fake_engine_factory
            from models.config import PRESETS, OPTConfig, get_config

            fake_config = get_config(model) if model in PRESETS else OPTConfig.from_hf_config(model)
            engine_factory = fake_engine_factory(fake_config)
        elif args.engine == "timed":
            engine_factory = _timed_engine_factory(model, args.profile)
        if args.backend == "ray":
            from jaxserve.runtime.ray_backend.deployment import launch_from_args

            controller = launch_from_args(model, plan, config, args)
        else:
            controller = Controller.from_plan(
                model, plan, engine_factory=engine_factory, config=config, dtype=args.dtype
            )
        for name, spec, devices in [] if args.backend == "ray" else place(plan):
            log.info(
                "instance %s: role=%s tp=%d x pp=%d devices=[%s]",
                name,
                spec.role,
                spec.tp,
                spec.pp,
                ", ".join(str(d) for d in devices),
            )
    except (PlanError, KeyError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    server_config = ServerConfig(
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        model_name=args.served_model_name,
        warmup=not args.no_warmup,
    )
    log.info("model %s (%s), deployment %s", model, controller.model_config.name, plan.describe())
    if server_config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)

    def ready(server: object) -> None:
        print(f"ready grpc={server.grpc_address} http={server.http_address}", flush=True)  # type: ignore[attr-defined]

    try:
        run_until_signal(controller, server_config, on_ready=ready)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
