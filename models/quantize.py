"""Serving a model at a weight precision: which weights become `models.quant.QuantizedWeight`s, from what.

A stage's module state (the pure dict `models.sharding.stage_module` builds) is placed in float as usual;
`quantize_state` then swaps its linear kernels (the fused q/k/v and gate/up ones included) and its embedding
tables (the tied head) for quantized weights, which the layers multiply with `quant_matmul`
(`models.layers.Linear` / `Embed`). Two sources of quantized weights:

* a GGUF file, served as stored (the default for a GGUF: `gguf_weights`): Q8_0 / Q4_0 / Q4_1 kept as they
  are, K-quants repacked losslessly (`models.quant.from_gguf`), q/k rows un-permuted with `take_rows` as the
  float loader un-permutes them; a tensor type we cannot serve quantized (F16, BF16, F32, ...) stays the
  float32 the loader dequantized, with a warning naming it;
* a float checkpoint at `quantization="int8"` (per-channel, symmetric) or `"int4"` (group-wise, asymmetric):
  `quantize_int8` / `quantize_int4` of the placed float weight (`requantized_weights`).

Norms, biases and OPT's learned positions stay float: they are a few KB a layer. On a stage split over tp a
weight is split by its output rows (each row's scales go with it: `models.quant.partition_spec`) where the
float kernel's output is split, replicated otherwise, and multiplied in the XLA form (XLA partitions its dot;
the C++ kernel is a custom call it cannot split).

Orbax checkpoints hold float states only: `models.orbax_checkpoint.save_checkpoint` refuses a quantized one
(re-quantize on load instead: it is deterministic).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models import gguf as gguf_file
from models.config import CheckpointError, LlamaConfig, ModelConfig
from models.families import model_class
from models.params import FUSIONS
from models.quant import (
    ACTIVATIONS,
    GGUF_TYPES,
    QuantFormatError,
    QuantizedWeight,
    concat_outputs,
    from_gguf,
    quantize_int4,
    quantize_int8,
)

log = logging.getLogger(__name__)

# The precisions an HF checkpoint can be served at (`--quantization`, `InstanceSpec.quantization`; the same
# names as `jaxserve.core.plan.QUANTIZATIONS`, which a test holds equal). None: the checkpoint's own.
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4", "w8a8", "fp8")
# The ones served by our own weight-only kernels.
WEIGHT_ONLY: tuple[str, ...] = ("int8", "int4")
INT4_GROUP = 64
# Asked of a GGUF file: serve it dequantized to the float dtype (the loader's float path; tests, baselines).
DEQUANTIZED = "dequantized"

# path of a weight in a stage's module state -> its float value -> its quantized form (None: keep it float)
WeightMaker = Callable[[tuple[Any, ...], Any], "QuantizedWeight | None"]
# a stage's first layer (in the whole model) -> that stage's maker
StageWeights = Callable[[int], WeightMaker]


class QuantizationError(ValueError):
    """A precision that cannot be served here: an unknown scheme, one asked of a GGUF, fp8 without hardware."""


def check_quantization(quantization: str | None, *, gguf: bool, platform: str | None = None) -> None:
    """One clear `QuantizationError` before any weight is read if `quantization` cannot be served from this
    source on this platform (`jax.default_backend()` unless given)."""
    if quantization is None:
        return
    if quantization == DEQUANTIZED:
        if not gguf:
            raise QuantizationError(f"{DEQUANTIZED!r} applies to a GGUF file; this source is float already")
        return
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"unknown quantization {quantization!r}; expected one of {', '.join(QUANTIZATIONS)}")
    if gguf:
        raise QuantizationError(
            f"--quantization {quantization} asks to re-quantize a GGUF file, which is already quantized and is "
            "served as stored; drop --quantization (or give a float checkpoint)"
        )
    platform = platform or jax.default_backend()
    if quantization == "fp8" and platform != "gpu":
        raise QuantizationError(
            f"fp8 needs a device with fp8 matmuls (H100 / H200); this one is {platform!r}: use int8 or int4"
        )
    if quantization not in WEIGHT_ONLY:
        raise QuantizationError(
            f"quantization {quantization!r} is not implemented yet (served today: {', '.join(WEIGHT_ONLY)})"
        )


def check_serving_dtype(dtype: str, platform: str | None = None) -> None:
    """One clear `QuantizationError` for 16-bit weights on the CPU backend, instead of a silent slowdown: XLA:CPU
    has no 16-bit matmul fast path, so a bfloat16 SmolLM2-135M decode step ran 9x slower than float32 (1121 ms
    against 120 ms, loaded machine; issue 40 saw a small benchmark not finish in 10 minutes). Fewer bytes a
    token on the CPU come from `--quantization int8 / int4` (or a quantized GGUF) instead."""
    platform = platform or jax.default_backend()
    if platform == "cpu" and str(dtype) in ("bfloat16", "float16"):
        raise QuantizationError(
            f"dtype {dtype} on the CPU backend: XLA:CPU has no 16-bit matmul fast path (a {dtype} decode step runs "
            "~10x slower than float32); serve float32, or --quantization int8 / int4 for fewer bytes a token"
        )


def stage_weights(source: str | Path, cfg: ModelConfig, quantization: str | None) -> StageWeights | None:
    """What each stage of a model from `source` quantizes (None: nothing, the float weights are served).

    A GGUF file is served as stored unless `quantization` is `DEQUANTIZED`; any other source at
    `quantization` if given. A precision that cannot be served raises `QuantizationError` first."""
    path = gguf_file.find_gguf(source) if Path(source).exists() else None
    check_quantization(quantization, gguf=path is not None)
    if path is not None:
        if quantization == DEQUANTIZED:
            return None
        f = gguf_file.open_gguf(path)
        return lambda start: gguf_weights(f, cfg, start)
    if quantization is None:
        return None
    make = requantized_weights(quantization)
    return lambda start: make


def is_quantized(state: Any) -> bool:
    """Whether a module state (or any pytree) holds a `QuantizedWeight`."""
    leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    return any(isinstance(x, QuantizedWeight) for x in leaves)


def _weight_paths(state: Mapping[Any, Any], prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of the weights a precision applies to: every 2-D `kernel`, and the token embedding / LM head."""
    out: list[tuple[Any, ...]] = []
    for key, value in state.items():
        path = (*prefix, key)
        if isinstance(value, Mapping):
            out.extend(_weight_paths(value, path))
        elif isinstance(value, QuantizedWeight):
            continue
        elif (key == "kernel" and np.ndim(value) == 2) or path in (
            ("embed_tokens", "embedding"),
            ("lm_head", "embedding"),
        ):
            out.append(path)
    return out


def _placed(w: QuantizedWeight, float_sharding: NamedSharding, is_table: bool) -> QuantizedWeight:
    """`w` on the float weight's mesh: its output rows split as the float weight's output was (kernels
    `[in, out]`: the second axis; tables `[V, E]`: the first), everything else replicated."""
    mesh = float_sharding.mesh
    spec = (*tuple(float_sharding.spec), None, None)
    out_axis = spec[0] if is_table else spec[1]
    if mesh.devices.size > 1:
        w = dataclasses.replace(w, impl="xla")
        if out_axis is not None and w.shape[1] % mesh.shape[out_axis]:
            out_axis = None
    sharding = NamedSharding(mesh, P(out_axis, None))
    # the same static fields (impl, activations): a tree of shardings must match the weight's structure
    return jax.device_put(
        w, dataclasses.replace(w, values=sharding, scales=sharding, mins=None if w.mins is None else sharding)
    )


def quantize_state(state: dict[Any, Any], shardings: Mapping[Any, Any], make: WeightMaker) -> dict[Any, Any]:
    """`state` (a stage's pure-dict module state) with each weight `make` quantizes replaced by its quantized
    form, placed by the float weight's sharding in `shardings` (the same tree); the rest kept as it is."""
    for path in _weight_paths(state):
        node, shard = state, shardings
        for p in path[:-1]:
            node, shard = node[p], shard[p]
        w = make(path, node[path[-1]])
        if w is not None:
            node[path[-1]] = _placed(w, shard[path[-1]], is_table=path[-1] == "embedding")
    return state


def requantized_weights(quantization: str) -> WeightMaker:
    """The maker of `quantization` ("int8" / "int4") from the placed float weights."""
    if quantization not in WEIGHT_ONLY:
        raise QuantizationError(f"no weight-only kernel for {quantization!r} (have: {', '.join(WEIGHT_ONLY)})")

    def make(path: tuple[Any, ...], value: Any) -> QuantizedWeight:
        w = np.asarray(jax.device_get(value), np.float32)
        if path[-1] == "embedding":
            w = w.T  # the table [V, E] is the head's [E, V]: one scale (group) per vocabulary row
        return quantize_int8(w) if quantization == "int8" else quantize_int4(w, INT4_GROUP)

    return make


ACTIVATIONS_ENV = "JAXSERVE_QUANT_ACTIVATIONS"


def gguf_activations() -> str:
    """What a GGUF's weights multiply at decode (`QuantizedWeight.activations`): $JAXSERVE_QUANT_ACTIVATIONS,
    "float32" (the default: x as given, exact parity with the dequantized model) or "int8" (x quantized per
    32-block, llama.cpp's arithmetic: ~2x faster Q4 decode matmuls on an AVX512-VNNI CPU; docs/performance.md)."""
    value = os.environ.get(ACTIVATIONS_ENV, "float32").strip().lower()
    if value not in ACTIVATIONS:
        raise ValueError(f"${ACTIVATIONS_ENV} must be one of {', '.join(ACTIVATIONS)}, not {value!r}")
    return value


def gguf_weights(f: gguf_file.GGUFFile, cfg: ModelConfig, layer_offset: int) -> WeightMaker:
    """The maker that reads each weight of a stage (its first layer the model's `layer_offset`) from the
    GGUF file `f` as stored (see the module docstring)."""
    if not isinstance(cfg, LlamaConfig):
        raise CheckpointError(f"{f.path}: a GGUF file holds a Llama-style model, the config is {cfg.name}'s")
    tensors = gguf_file.hf_tensors(f, cfg)
    naming = model_class(cfg).HF_NAMING
    prefix = naming.prefixes[0]
    warned: set[str] = set()
    activations = gguf_activations()

    def hf_name(path: tuple[Any, ...], part: str) -> str:
        if path[0] == "layers":
            suffix, _ = naming.layer_names[(part, "kernel")]
            return f"{prefix}layers.{layer_offset + int(path[1])}.{suffix}"
        name, _ = naming.top_names[(part,)]
        return name if (part,) in naming.unprefixed else prefix + name

    def one(name: str) -> QuantizedWeight | None:
        t = tensors[name]
        kind = t.info.type_name
        if kind not in GGUF_TYPES:
            if kind not in ("F32",) and kind not in warned:
                warned.add(kind)
                log.warning("%s: GGUF tensor type %s (first: %s) is served dequantized to float32", f.path, kind, name)
            return None
        try:
            w = from_gguf(t.info.data, kind, t.shape[-1])
        except QuantFormatError as e:
            raise QuantFormatError(f"{f.path}: tensor {t.info.name}: {e}") from e
        for part, what in ((w.scales, "scales"), (w.mins, "mins")):
            if part is not None and not np.isfinite(np.asarray(part)).all():
                bad = np.argwhere(~np.isfinite(np.asarray(part)))[0].tolist()
                raise QuantFormatError(
                    f"{f.path}: tensor {t.info.name} ({kind}): {what} not finite (first at row {bad[0]}, block "
                    f"{bad[1]}): a corrupt file"
                )
        return w.take_rows(t.row_map) if t.row_map is not None else w

    def make(path: tuple[Any, ...], value: Any) -> QuantizedWeight | None:
        del value
        module = str(path[-2])
        parts = FUSIONS.get(module, (module,))
        weights = [one(hf_name(path, part)) for part in parts]
        if any(w is None for w in weights):
            return None
        if len(weights) == 1:
            return dataclasses.replace(weights[0], activations=activations)  # type: ignore[arg-type,type-var]
        try:
            return dataclasses.replace(concat_outputs(weights), activations=activations)  # type: ignore[arg-type]
        except QuantFormatError as e:  # e.g. a Q4_K_M file's q/k in Q4_K beside v in Q6_K: not fusable
            log.warning("%s: layer %s %s served dequantized: %s", f.path, path[1], module, e)
            return None

    return make
