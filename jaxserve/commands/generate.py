"""`jaxserve generate`: offline generation for one prompt (a thin shell over `jaxserve.LLM`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from jaxserve.commands.common import (
    DEFAULT_DEPLOYMENT,
    add_serving_limit_flags,
    default_model,
    ensure_host_devices,
    limits_from_args,
)
from jaxserve.core.limits import DEFAULT_LIMITS
from jaxserve.core.request import DEFAULT_MAX_TOKENS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF OPT dir, jaxserve checkpoint dir, or preset name (random weights); default: the shipped code model",
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a tokenizer; presets fall back to bytes)")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 2,100,31")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--deployment", default=DEFAULT_DEPLOYMENT, help="deployment spec or plan JSON file")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--json", action="store_true", help='print {"token_ids": [...], "text": ...}')
    add_serving_limit_flags(
        parser.add_argument_group("serving limits (default: the plan file's, else jaxserve/core/limits.py)")
    )


def run(args: argparse.Namespace) -> int:
    from jaxserve.core.errors import JaxServeError
    from jaxserve.core.plan import PlanError, parse_deployment

    try:
        plan = parse_deployment(args.deployment)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.prompt is None and args.prompt_ids is None:
        print("error: give --prompt TEXT or --prompt-ids 2,100,31", file=sys.stderr)
        return 2
    prompt_ids: list[int] | None = None
    if args.prompt_ids is not None:
        try:
            prompt_ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            print(f"error: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
    try:
        limits = limits_from_args(args, plan.limits or DEFAULT_LIMITS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if limits.num_kv_blocks is None:  # a plan's "what memory holds": the embedded default
        limits = dataclasses.replace(limits, num_kv_blocks=DEFAULT_LIMITS.num_kv_blocks)
    ensure_host_devices(plan.num_devices)

    from jaxserve.core.request import SamplingParams
    from jaxserve.llm import LLM

    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        with LLM(model=args.model or default_model(), deployment=plan, dtype=args.dtype, limits=limits) as llm:
            out = llm.generate(prompt_ids if prompt_ids is not None else args.prompt, sampling)[0]
            text = out.text if out.text is not None else llm.codec.decode(out.token_ids)
    except (JaxServeError, PlanError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"token_ids": list(out.token_ids), "text": text}))
    else:
        print(text)
        print(
            f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}] token_ids={list(out.token_ids)}",
            file=sys.stderr,
        )
    return 0
