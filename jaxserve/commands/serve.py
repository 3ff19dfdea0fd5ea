"""`jaxserve serve`: run a deployment behind the gRPC and OpenAI-compatible HTTP servers.

    jaxserve serve                                   # the embedded default: default_model(), DEFAULT_DEPLOYMENT
    jaxserve serve --deployment disagg:prefill=tp2,decode=tp1 --model DIR|PRESET
    jaxserve serve --plan plan.json --grpc-port 0 --http-port 0 --api-key KEY

Logs one line per instance (role, tp x pp, devices), warms the deployment up
(`controller.warmup()`: compiles before the first client; `--no-warmup` skips it), logs
the time to ready, then prints `ready grpc=HOST:PORT http=HOST:PORT` on stdout once both
servers accept requests. JAX's persistent compilation cache (`--compile-cache`, default
under the user's cache directory) makes a restart's warm-up fast.
SIGINT/SIGTERM drain in-flight requests and stop; before the ready line (loading, warm-up) they stop at
once (status 0, no ready line).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jaxserve.commands.common import (
    DEFAULT_DEPLOYMENT,
    add_serving_limit_flags,
    configure_logging,
    default_model,
    ensure_host_devices,
    limits_from_args,
    pin_to_cpus_flag,
)
from jaxserve.commands.engine_backends import ENGINE_BACKENDS, engine_name
from jaxserve.commands.server_keys import ADMIN_KEY_ENV, API_KEY_ENV, server_keys
from jaxserve.core.limits import DEFAULT_LIMITS, ServingLimits
from jaxserve.core.plan import QUANTIZATIONS

if TYPE_CHECKING:
    from jaxserve.core.plan import DeploymentPlan
    from jaxserve.runtime.instances import EngineFactory

# Store every program: a warm start loads a KV insert in ~10 ms where compiling it again took ~60 ms (six of
# them, and the padding programs, before ready): 0.0 against 0.1 made warm starts ~0.4 s faster (docs/performance.md).
COMPILE_CACHE_MIN_COMPILE_S = 0.0


def compile_cache_dir(value: str | None) -> Path | None:
    """The `--compile-cache` value as a directory; None when it is `off`."""
    from jaxserve.runtime.compilation.cache import default_cache_dir

    if value is None:
        return default_cache_dir()
    if value.lower() == "off":
        return None
    return Path(value).expanduser()


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
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="serve a float checkpoint's weights at this precision (int8: per-channel weight-only, int4: group-wise "
        "weight-only); a plan entry's own quantization wins. Default: the checkpoint's own (a GGUF as stored)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="jaxserve's own log level (default info: one line per event that matters); third-party libraries "
        "(JAX, Orbax/absl, Ray) log warnings and errors only, unless debug",
    )
    for flag, what in (("--allowed-hosts", "HTTP Host names served besides this server's address and loopback "
                        "(a proxy's public name; '*': any, which lets DNS-rebinding pages in)"),
                       ("--allowed-origins", "web origins the inference API answers cross-origin, with CORS "
                        "(default none; never the operator routes)")):  # fmt: skip
        parser.add_argument(flag, nargs="+", default=(), type=_non_empty, metavar="NAME", help=what)
    parser.add_argument("--grpc-port", type=int, default=50051, help="0 picks a free port")
    parser.add_argument("--http-port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--api-key", default=None, help=f"require `Authorization: Bearer KEY` (default: env {API_KEY_ENV}, else none)"
    )
    parser.add_argument(
        "--admin-key",
        default=None,
        help=f"the credential of /admin/* and /debug/* (default: env {ADMIN_KEY_ENV}); without one they are off, "
        "except on a loopback server with no --api-key (the inference key never grants admin)",
    )
    parser.add_argument("--tls-cert", type=Path, help="PEM certificate chain: serve gRPC and HTTP over TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key for --tls-cert")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20, help="HTTP body / gRPC message limit")
    parser.add_argument(
        "--engine",
        type=engine_name,
        choices=sorted(ENGINE_BACKENDS),
        default="model",
        help="model: the real engine (any supported model family); fake: the hand-computable test engine (no model); "
        "timed: sleeps --profile's step times (no model). `opt`, the old spelling of `model`, is still accepted",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="latency profile (built-in name or JSON file): what --engine timed sleeps, and what the replanner plans with",
    )
    parser.add_argument("--no-warmup", action="store_true", help="skip the warm-up (compilation) before the ready line")
    parser.add_argument(
        "--warmup-buckets",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="warm-up compiles every padded shape the limits allow, not only one request's (default: on)",
    )
    parser.add_argument(
        "--background-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ready once the buckets that hold all others are compiled; the rest compile on a background thread "
        "while work of a bucket not compiled yet runs padded up to a compiled one (never waiting on a compile). "
        "--no-background-warmup compiles every bucket before the ready line (default: on)",
    )
    parser.add_argument(
        "--warmup-logprobs",
        action="store_true",
        help="the bucket warm-up compiles the logprob programs too, so a first request asking for logprobs "
        "compiles nothing (longer warm-up; off by default)",
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
    # Defaults: the plan's recorded limits with --plan, else jaxserve/core/limits.py (what plan/simulate assume).
    add_serving_limit_flags(
        limits,
        num_kv_blocks_help="paged KV blocks per decode / colocated instance (default: the plan's, else sized from "
        "the memory the weights leave, --kv-memory-fraction; the fake/timed engines and the Ray backend: "
        f"{DEFAULT_LIMITS.num_kv_blocks})",
    )
    limits.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=0.9,
        help="without --num-kv-blocks: the KV pool takes this fraction of each device's memory less what the "
        "weights use (CPU: of the host's available memory, shared by its devices), capped at what a full "
        "decode batch of the longest sequences can hold (vLLM's gpu_memory_utilization)",
    )
    limits.add_argument(
        "--decode-steps-per-call",
        type=int,
        default=1,
        help="decode / colocated instances run up to N decode steps per engine call (multi-step decoding: "
        "tokens reach clients N at a time; 1 = one step per call)",
    )
    limits.add_argument(
        "--kv-checksum",
        action="store_true",
        help="check a checksum of every KV pulled from a prefill instance (both backends): a corrupted one "
        "costs its request a re-prefill; one extra read of the KV per side (shape, dtype and length are always "
        "checked)",
    )
    limits.add_argument("--max-queued-requests", type=int, default=256, help="admission control bound")
    limits.add_argument("--max-tokens-limit", type=int, default=None, help="largest max_tokens accepted")
    cache = parser.add_argument_group("prefix caching (docs/prefix_caching.md)")
    cache.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep KV blocks content-addressed on every instance, compute and pull only uncached prompt parts, "
        "route by cached prefix (default: on; --no-prefix-caching turns it off)",
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
    replan = parser.add_argument_group("replanning (docs/replanning.md)")
    replan.add_argument(
        "--replan",
        choices=["off", "advise", "auto"],
        default="off",
        help="off: monitor only; advise: log and expose a better plan; auto: also switch to it live (embedded)",
    )
    replan.add_argument(
        "--num-devices",
        type=int,
        default=None,
        help="CPU hosts: virtual devices to create (live switches build new instances on the free ones; "
        "default: the plan's count, at least 8 with --replan advise/auto)",
    )
    replan.add_argument("--device", default="cpu", help="device the profile / roofline describes (default cpu)")
    replan.add_argument("--ttft", type=float, default=1.0, help="TTFT SLO in seconds, for the monitor and the planner")
    replan.add_argument("--tpot", type=float, default=0.2, help="TPOT SLO in seconds")
    replan.add_argument("--window", type=float, default=300.0, help="monitor window, seconds")
    replan.add_argument("--slice", type=float, default=30.0, help="monitor slice (and loop tick), seconds")
    replan.add_argument("--sustain", type=float, default=120.0, help="a shift must hold this long, seconds")
    replan.add_argument("--cooldown", type=float, default=1800.0, help="at most one replan per this many seconds")
    parser.add_argument(
        "--cpus",
        default=None,
        help="run on these CPUs only, e.g. 0 or 0-3 (CPU hosts: keeps a load generator off the serving cores)",
    )


def serving_limits(args: argparse.Namespace, plan: DeploymentPlan) -> ServingLimits:
    """The limits to serve with: each flag given on the command line, else the plan's, else the defaults.

    A limit's flag is its `ServingLimits` name (`--max-decode-batch` -> `max_decode_batch`); `chunk_size` has
    none here: a colocated instance's chunk comes with the deployment (`colocated:tp1,chunk=N`)."""
    return limits_from_args(args, plan.limits or DEFAULT_LIMITS)


def run(args: argparse.Namespace) -> int:
    import logging

    from jaxserve.core.plan import DeploymentPlan, PlanError, parse_deployment

    configure_logging(args.log_level)
    log = logging.getLogger("jaxserve.serve")
    try:
        api_key, admin_key = server_keys(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
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
    if not pin_to_cpus_flag(args.cpus):
        return 2
    from jaxserve.serving.start_up_signals import StartUpSignals

    start_up = StartUpSignals.install()  # from here a signal stops at once (status 0); the event loop takes over
    highest = max(d for inst in plan.instances for d in (inst.devices or (0,)))
    wanted = args.num_devices or (max(highest + 1, 8) if args.replan != "off" else highest + 1)
    ensure_host_devices(max(wanted, highest + 1))
    if args.engine == "model" and args.backend != "ray":
        from models.kernels import cpu as cpu_kernel

        if cpu_kernel.only_cpu_expected():  # a fresh machine's build runs beside the imports and weight loading
            cpu_kernel.start_build()  # the first paged step's trace waits for it
    cache_dir = compile_cache_dir(args.compile_cache)
    if cache_dir is not None:
        from jaxserve.runtime.compilation.cache import enable_private_compilation_cache

        try:
            enable_private_compilation_cache(cache_dir, COMPILE_CACHE_MIN_COMPILE_S)
        except OSError as e:
            print(f"error: --compile-cache: {e}", file=sys.stderr)
            return 2
        log.info("compilation cache: %s", cache_dir)

    from jaxserve.commands.replan import build_replan_loop
    from jaxserve.core.scheduling import PrefixPolicy
    from jaxserve.model_registry import ModelRegistryError, resolve_model_source
    from jaxserve.runtime.controller import AdmissionConfig, Controller, ControllerConfig, WarmupConfig
    from jaxserve.runtime.instances import place
    from jaxserve.serving.server import ServerConfig, run_until_signal

    try:
        model = resolve_model_source(args.model or plan.model or default_model())
    except ModelRegistryError as e:  # a registry name not pulled yet (it says what to run)
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.engine == "model" and args.quantization is not None:  # one clear error before anything loads
        from models.gguf import find_gguf
        from models.quantize import QuantizationError, check_quantization

        try:
            check_quantization(args.quantization, gguf=find_gguf(model) is not None)
        except QuantizationError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    limits = serving_limits(args, plan)
    if limits.num_kv_blocks is None:  # a plan's "what memory holds": sized below (model engine), else the default
        limits = dataclasses.replace(limits, num_kv_blocks=DEFAULT_LIMITS.num_kv_blocks)
    if args.decode_steps_per_call < 1:
        print("error: --decode-steps-per-call must be >= 1", file=sys.stderr)
        return 2
    config = ControllerConfig(
        limits=limits,
        admission=AdmissionConfig(max_queued_requests=args.max_queued_requests, max_tokens_limit=args.max_tokens_limit),
        warmup=WarmupConfig(
            buckets=args.warmup_buckets, logprobs=args.warmup_logprobs, background=args.background_warmup
        ),
        prefix_policy=PrefixPolicy(enabled=args.prefix_caching, local_prefill_tokens=args.local_prefill_tokens),
        prefill_num_kv_blocks=args.prefill_kv_blocks,
        decode_steps_per_call=args.decode_steps_per_call,
        drain_timeout_s=args.drain_timeout,
        kv_checksum=args.kv_checksum,
    )
    if not 0.0 < args.kv_memory_fraction <= 1.0:
        print("error: --kv-memory-fraction must be in (0, 1]", file=sys.stderr)
        return 2
    # The pool's size is sized from memory unless a number was given (the flag, or a plan file's limits).
    pool_given = args.num_kv_blocks is not None or (plan.limits is not None and plan.limits.num_kv_blocks is not None)
    try:
        import time

        started = time.monotonic()
        engine_factory: EngineFactory | None = None
        if args.backend == "ray":
            from jaxserve.runtime.ray_backend.deployment import launch_from_args

            controller = launch_from_args(model, plan, config, args)
        else:
            backend = ENGINE_BACKENDS[args.engine](model, args)
            engine_factory = backend.factory
            sized = backend.pool_from_memory and not pool_given
            if sized:
                from jaxserve.runtime.pool_sizing import kv_blocks_from_memory

                blocks, engine_factory = kv_blocks_from_memory(
                    plan, engine_factory, config.limits, args.kv_memory_fraction
                )
                if blocks is not None:
                    config = dataclasses.replace(
                        config, limits=dataclasses.replace(config.limits, num_kv_blocks=blocks)
                    )
            log.info(
                "KV pool: %d blocks x %d tokens per decode / colocated instance (%s)",
                config.limits.num_kv_blocks,
                config.limits.block_size,
                f"--kv-memory-fraction {args.kv_memory_fraction}" if sized else "given",
            )
            controller = Controller.from_plan(
                model, plan, engine_factory=engine_factory, config=config, dtype=args.dtype, transfer=backend.transfer
            )
        build_s = time.monotonic() - started
        builder: object = engine_factory
        if args.backend == "ray":
            from jaxserve.runtime.ray_backend.deployment import RayActors, RayController

            assert isinstance(controller, RayController)
            builder = RayActors(controller)
        loop = build_replan_loop(args, controller, builder, build_s)
        for name, spec, devices in [] if args.backend == "ray" else place(plan):
            log.info(
                "instance %s: role=%s tp=%d x pp=%d precision=%s devices=[%s]",
                name,
                spec.role,
                spec.tp,
                spec.pp,
                spec.quantization or "checkpoint",  # the plan's per-phase precision (`jaxserve plan --precisions`)
                ", ".join(str(d) for d in devices),
            )
    except (PlanError, KeyError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    server_config = ServerConfig(
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        api_key=api_key,
        admin_key=admin_key,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        max_request_bytes=args.max_request_bytes,
        drain_timeout_s=args.drain_timeout,
        model_name=args.served_model_name,
        warmup=not args.no_warmup,
        allowed_hosts=tuple(args.allowed_hosts),
        allowed_origins=tuple(args.allowed_origins),
    )
    log.info("model %s (%s), deployment %s", model, controller.model_config.name, plan.describe())
    if server_config.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s without an API key: anyone who can reach it can use it", args.host)

    def ready(server: object) -> None:
        loop.start()  # after the warm-up: its requests are not the workload's
        print(f"ready grpc={server.grpc_address} http={server.http_address}", flush=True)  # type: ignore[attr-defined]

    try:
        run_until_signal(controller, server_config, on_ready=ready, admin=loop, start_up=start_up)
    except (OSError, ValueError) as e:  # ValueError: the model's chat template does not parse
        print(f"error: {model}: {e}" if isinstance(e, ValueError) else f"error: {e}", file=sys.stderr)
        return 1
    finally:
        loop.stop()
    log.info("stopped")
    return 0


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name")
    return text.strip()
