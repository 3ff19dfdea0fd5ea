"""Latency and memory model of one serving instance (DistServe Appendix A), per shard and per pipeline stage.

Forms
-----
**Appendix form** (per model, per tensor-parallel degree `tp`; `h`, `m` = hidden and FFN sizes, `L` layers,
`t = Σ lᵢ`, `t₂ = Σ lᵢ²`, `b` = FlashAttention block size)::

    T_prefill = L·[C1·t·(4h² + 2hm)/tp + C2·3(h/tp)·t₂/b] + C1·B·V·h/tp + 2L·AR(t) + C3
    T_decode  = L·[max(C4, C1·B)·(4h² + 2hm)/tp + C5·3(h/tp)·Σctx] + C4·V·h/tp + 2L·AR(B) + C6

The GEMM terms count multiply-adds of one shard: under tensor parallelism each device holds 1/tp of
the QKV/FFN-in columns and of the out/FFN-out rows, so it does `t·(4h² + 2hm)/tp` multiply-adds and
reads `(4h² + 2hm)/tp` weights per layer (the paper writes "h divided by tp", which would count
`4t(h/tp)²`; the per-shard product is `t·4h·h/tp`).

Llama-style models (grouped K/V heads, SwiGLU) use the same form with their shapes
(`models.config.layer_matmul_params`): the GEMM weights of a layer are `h·q_dim + 2h·kv_dim + q_dim·h`
for attention and `3h·m` for the MLP (OPT: `4h²` and `2hm`); attention's `3(h/tp)` becomes
`q_dim/tp + 2·kv_read` — the shard's query width plus the K and V heads it reads (`attention_width`).
When tp is a multiple of the K/V heads (`models.config.kv_heads_split`) every device holds the k/v
projections and the K/V cache whole (they are replicated, not split): those weights count on every
device, the KV bytes per token per device are all K/V heads', and attention reads the one K/V head its
query heads use. `AR(n)` is a ring all-reduce of `n·h` activations
(two per layer: after attention and after the FFN): `2(tp−1)/tp · n·h·bytes / link + latency`.
`V·h` is the LM head (only the last position of each request). In decode, `max(C4, C1·B)` is the
roofline: weight reads dominate until the batch is large enough for the GEMMs to be compute-bound.
C6 (decode overhead) defaults to C3; the paper folds it into C4.

**Folded form** (what the public DistServe artifact ships; milliseconds, per (engine, model, tp))::

    prefill = a + b·Σlᵢ + c·Σlᵢ²
    decode  = a + b·Σctxᵢ + c·B      (one (a, b, c) for B < decode_batch_split (95), another at or above)

Pipeline stages. An instance with `pp` stages holds `L/pp` layers per stage. A batch's *latency*
through the pipe is the sum of its stage times plus `pp − 1` activation sends; successive batches
overlap, so *throughput* is set by the stage time. The simulator therefore tracks per-stage busy
times (see `placement/simulator.py`); `stage_*` methods return one stage's time. For the folded
form a stage is 1/pp of the whole-model time (the constants are not split by layer in the artifact).
Decoding splits the running batch into `k = min(B, pp)` micro-batches; a token of every request
comes out once per round of `pp · (stage(B/k) + send)`.

Profile files
-------------
JSON, one object::

    {
      "name": "a100-80gb-distserve",         # what --profile NAME selects
      "device": "a100-80gb",                 # the hardware the numbers were measured on
      "decode_batch_split": 95,              # folded form: first batch size of the large-batch regime
      "entries": [
        # folded form, milliseconds
        {"engine": "disagg", "model": "opt-13b", "tp": 1,
         "prefill": [a, b, c], "decode_small": [a, b, c], "decode_large": [a, b, c],
         "max_batch_tokens": 8192,            # optional, the engine's token cap per prefill step
         "step_overhead": [s, s_per_ctx_token, prefill_s]},  # optional per-step host overhead (below)
        # Appendix-A form, seconds per unit (what `jaxserve profile` writes)
        {"engine": "any", "model": "opt-13b", "tp": 2,
         "C1": s_per_mac, "C2": s_per_elem, "C3": s, "C4": s_per_elem, "C5": s_per_elem,
         "C6": s,                             # optional, decode overhead (default C3)
         "attention_tile": 16,                # optional, FlashAttention tile b (default 16; older files: "block_size")
         "allreduce_s_per_byte": x,           # optional; default from the device link bandwidth
         "L_m": 512,                          # optional, prefill token budget that saturates the device
         "engine_padding": {...},             # optional: fitted in the engine's padded shapes (padding.py)
         "bucket_costs": {"prefill": [[tokens, s], ...], "decode": [[rows, s], ...], "C2": x, "C5": y}}
                                              # optional: a bucketed engine's measured costs per bucket, which
                                              # then charge instead of C1..C6 (bucket_latency.py)
      ]
    }

`engine` is `dist` (prefill-only / decode-only engine, used for disaggregated deployments), `coloc`
(colocated continuous-batching engine) or `any`. A lookup for (engine, model, tp) takes the exact engine
first, then `any`. Missing (model, tp) pairs are simply unsupported by that profile.

Precision. An entry is at the checkpoint's own precision unless it says `"quantization": "int8"` (one of
`jaxserve.core.plan.QUANTIZATIONS`): then it was fitted with the weights at that precision and sits beside the
checkpoint's entry of the same (engine, model, tp). An instance at a precision the profile has no entry for is
the checkpoint's entry times the roofline's ratio for each step (`placement.precision.RooflineRatio`); without a
profile the roofline itself takes the precision's weight bytes and matmul rate (`AppendixModel.gemm_*`).

Memory model: `weight_bytes_per_device`, `kv_bytes_per_token_per_device` and `kv_capacity_tokens`
(the KV slots an instance holds after its weights, with `DeviceSpec.usable_memory_fraction` of memory
usable; K/V bytes count the K/V heads a device stores: `kv_heads/tp` when they split, all when replicated). With the default 0.925 it gives OPT-13B on A100-80GB 65,614 tokens at tp1 (artifact: 66,144,
−0.8 %) and 162,598 at tp2 (163,008, −0.3 %).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import numpy as np

from jaxserve.core.limits import DEFAULT_LIMITS
from jaxserve.core.plan import QUANTIZATIONS
from models.config import (
    ModelConfig,
    kv_heads_per_device,
    kv_heads_read_per_device,
    kv_heads_split,
    layer_matmul_params,
    replicated_layer_params,
)
from placement.bucket_latency import BucketCosts, BucketModel
from placement.hardware import DeviceSpec
from placement.padding import EnginePadding, PaddedModel
from placement.precision import RooflineRatio, matmul_speedup
from placement.precision import weight_bytes as precision_weight_bytes
from placement.stage_latency import StageLatency

DeploymentKind = Literal["disagg", "colocated"]  # the plan's kinds (`DeploymentPlan.kind`)
_KIND_ALIASES = {"dist": "disagg", "coloc": "colocated"}  # profile files written before the rename
DEFAULT_ATTENTION_TILE = 16  # FlashAttention tile b (tokens): a kernel constant of the formula, not the KV page
DEFAULT_PREFILL_TOKENS = 512  # L_m: the paper's saturation point for a 13B model on an A100


# ---------------------------------------------------------------------------------------------
# Per-shard sizes (what the hand-computation test checks)
# ---------------------------------------------------------------------------------------------
def layer_gemm_macs(cfg: ModelConfig, tp: int, num_tokens: int) -> float:
    """Multiply-adds of one layer's GEMMs on one tensor-parallel shard for `num_tokens` tokens.

    q/o and the MLP split `tp` ways; k/v split too unless `tp` replicates the K/V heads (`models.config`).
    OPT: `t·(4h² + 2hm)/tp`; Llama-style: `t·(2h·q_dim + 3h·ffn)/tp + t·2h·kv_dim/(tp or 1)`.
    """
    split, replicated = _split_layer_elems(cfg, tp)
    return num_tokens * split / tp + num_tokens * replicated


def _split_layer_elems(cfg: ModelConfig, tp: int) -> tuple[int, int]:
    """Matmul weights of one layer as (split over tp, held whole by every device)."""
    qo_mlp, kv = layer_matmul_params(cfg)
    return (qo_mlp + kv, 0) if kv_heads_split(cfg, tp) else (qo_mlp, kv)


def layer_gemm_flops(cfg: ModelConfig, tp: int, num_tokens: int) -> float:
    return 2.0 * layer_gemm_macs(cfg, tp, num_tokens)


def layer_weight_bytes(cfg: ModelConfig, tp: int) -> float:
    """GEMM weight bytes of one layer held (and read once per step) by one shard."""
    return layer_gemm_macs(cfg, tp, 1) * cfg.dtype_bytes


def attention_width(cfg: ModelConfig, tp: int) -> float:
    """Elements per token one shard's attention touches per layer: its query heads' width plus the K and V
    heads it reads, `q_dim/tp + 2·kv_read` (OPT: 3h/tp, the Appendix's `3(h/tp)`)."""
    return attention_factor(cfg, tp) * (cfg.num_heads * cfg.head_dim / tp)


def attention_factor(cfg: ModelConfig, tp: int) -> float:
    """`attention_width` over the shard's query width: the Appendix's 3 for multi-head attention (Q, K, V
    alike), less with grouped K/V heads (Llama-3.1-70B at tp 8: 1 + 2/8). Kept as a factor so the OPT
    terms are the same floating-point products as `C·3·(h/tp)`."""
    kv_read = kv_heads_read_per_device(cfg, tp) * cfg.head_dim
    return 1 + 2 * kv_read / (cfg.num_heads * cfg.head_dim / tp)


def layer_kv_read_bytes(cfg: ModelConfig, tp: int, total_context: int) -> float:
    """K and V bytes one shard reads in one decode step of one layer (the K/V heads its query heads use)."""
    return 2 * kv_heads_read_per_device(cfg, tp) * cfg.head_dim * total_context * cfg.dtype_bytes


def allreduce_bytes_per_device(cfg: ModelConfig, tp: int, num_tokens: int) -> float:
    """Bytes each device sends in one ring all-reduce of `num_tokens` activations."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) / tp * num_tokens * cfg.hidden_size * cfg.dtype_bytes


# ---------------------------------------------------------------------------------------------
# Memory model
# ---------------------------------------------------------------------------------------------
def weight_bytes_per_device(cfg: ModelConfig, tp: int, pp: int, quantization: str | None = None) -> float:
    """Weights on one device of the heaviest stage: ceil(L/pp) layers plus the embeddings, sharded tp ways
    except the k/v projections a tp group replicates (tp a multiple of the K/V heads). At a `quantization`
    the layers' matmul weights take its bytes (`placement/precision.py`), the rest stays at the dtype's."""
    layers = math.ceil(cfg.num_layers / pp)
    replicated = layers * replicated_layer_params(cfg, tp)
    params = layers * cfg.num_layer_params + cfg.num_embedding_params - replicated
    full = params * cfg.dtype_bytes / tp + replicated * cfg.dtype_bytes
    if quantization is None:
        return full  # the same floating-point product as before precisions existed
    saved_per_weight = cfg.dtype_bytes - precision_weight_bytes(quantization, cfg.dtype_bytes)
    return full - layers * layer_gemm_macs(cfg, tp, 1) * saved_per_weight


def kv_bytes_per_token_per_device(cfg: ModelConfig, tp: int, pp: int) -> float:
    """K and V of one token on one device of the heaviest stage: its K/V heads (all of them when replicated)."""
    layers = math.ceil(cfg.num_layers / pp)
    return 2 * layers * kv_heads_per_device(cfg, tp) * cfg.head_dim * cfg.dtype_bytes


def kv_capacity_tokens(cfg: ModelConfig, device: DeviceSpec, tp: int, pp: int, quantization: str | None = None) -> int:
    """KV-cache slots (tokens) one instance holds; 0 when the weights do not fit. The KV stays at the dtype:
    smaller weights (a `quantization`) leave it more room."""
    free = device.usable_memory_bytes - weight_bytes_per_device(cfg, tp, pp, quantization)
    if free <= 0:
        return 0
    return int(free // kv_bytes_per_token_per_device(cfg, tp, pp))


def fits(
    cfg: ModelConfig,
    device: DeviceSpec,
    tp: int,
    pp: int,
    min_kv_tokens: int | None = None,
    quantization: str | None = None,
) -> bool:
    """Whether the weights fit with room for at least one max-length sequence of KV cache."""
    need = cfg.max_position_embeddings if min_kv_tokens is None else min_kv_tokens
    return kv_capacity_tokens(cfg, device, tp, pp, quantization) >= need


# ---------------------------------------------------------------------------------------------
# Instance latency
# ---------------------------------------------------------------------------------------------
def prefill_stats(lengths: np.ndarray) -> tuple[float, float, int]:
    """(Σl, Σl², B) of a batch of prompt lengths."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return float(lengths.sum()), float((lengths * lengths).sum()), len(lengths)


def pipeline_prefill_s(model: StageLatency, lengths: np.ndarray) -> float:
    """Latency of one prefill batch through all stages of an idle pipe."""
    t, t2, b = prefill_stats(lengths)
    return model.pp * model.prefill_stage_s(t, t2, b) + (model.pp - 1) * model.send_s(int(t))


def pipeline_decode_round_s(model: StageLatency, batch: int, ctx_sum: float) -> float:
    """Time between two tokens of a request in a decode instance running this batch.

    With pp stages the batch is split into k = min(B, pp) micro-batches that chase each other round
    the pipe; every stage handles each micro-batch once per round, and each micro-batch also has to
    cross every stage, so a round is pp · (stage time of the largest micro-batch + one send). The
    largest micro-batch has ceil(B/k) requests and is given their share of the context.
    """
    if batch == 0:
        return 0.0
    if model.pp == 1:
        return model.decode_stage_s(batch, ctx_sum)
    k = min(batch, model.pp)
    micro = -(-batch // k)
    return model.pp * (model.decode_stage_s(micro, ctx_sum * micro / batch) + model.send_s(micro))


@dataclasses.dataclass(frozen=True)
class StepOverhead:
    """Host time per step beyond the kernels: `fixed_s + per_ctx_token_s · Σ context`, plus `prefill_s · pp`
    on a step with prompt rows. Charged once per step on the first pipeline stage."""

    fixed_s: float = 0.0
    per_ctx_token_s: float = 0.0
    prefill_s: float = 0.0

    def step_s(self, ctx_tokens: float, pp: int, has_prefill: bool) -> float:
        return self.fixed_s + self.per_ctx_token_s * ctx_tokens + (self.prefill_s * pp if has_prefill else 0.0)


NO_OVERHEAD = StepOverhead()


@dataclasses.dataclass(frozen=True)
class AppendixCoefficients:
    """C1..C6 of the appendix form (seconds per multiply-add / per element / fixed)."""

    C1: float
    C2: float
    C3: float
    C4: float
    C5: float
    C6: float | None = None
    attention_tile: int = DEFAULT_ATTENTION_TILE  # FlashAttention tile b of the C2/C5 terms
    allreduce_s_per_byte: float | None = None
    prefill_tokens: int | None = None  # L_m
    max_batch_tokens: int | None = None  # the engine's token cap per prefill step
    overhead: StepOverhead | None = None
    # measured per-bucket costs of a bucketed engine: then they charge the GEMM side and C2/C5 the attention
    buckets: BucketCosts | None = None

    @classmethod
    def roofline(cls, device: DeviceSpec, dtype_bytes: int = 2) -> AppendixCoefficients:
        """Coefficients from the device roofline: GEMMs at the achievable FLOP rate, the rest at HBM speed."""
        s_per_mac = 2.0 / (device.peak_flops * device.flops_efficiency)
        s_per_elem = dtype_bytes / (device.mem_bandwidth * device.bandwidth_efficiency)
        return cls(C1=s_per_mac, C2=s_per_elem, C3=device.step_overhead_s, C4=s_per_elem, C5=s_per_elem)


@dataclasses.dataclass(frozen=True)
class AppendixModel:
    """The appendix form for one (model, tp, pp) instance. Stage = ceil(L/pp) layers (+ LM head)."""

    cfg: ModelConfig
    coeffs: AppendixCoefficients
    tp: int
    pp: int
    link_bandwidth: float  # bytes/s for all-reduce inside the tp group
    stage_link_bandwidth: float  # bytes/s between adjacent stages
    link_latency_s: float = 10e-6
    # The layer matmuls' precision (`placement/precision.py`): their rate over the coefficients' (C1 ÷ it) and
    # their weight bytes over the coefficients' (C4 × it). The LM head, attention and all-reduces keep theirs.
    gemm_speedup: float = 1.0
    gemm_bytes_ratio: float = 1.0
    _layers: int = dataclasses.field(init=False, repr=False, compare=False)
    _weights: float = dataclasses.field(init=False, repr=False, compare=False)
    _ar_per_token: float = dataclasses.field(init=False, repr=False, compare=False)
    _ar_fixed: float = dataclasses.field(init=False, repr=False, compare=False)
    _attn_prefill: float = dataclasses.field(init=False, repr=False, compare=False)
    _attn_decode: float = dataclasses.field(init=False, repr=False, compare=False)
    _lm_head: float = dataclasses.field(init=False, repr=False, compare=False)
    _decode_overhead: float = dataclasses.field(init=False, repr=False, compare=False)
    _send_bytes_per_token: int = dataclasses.field(init=False, repr=False, compare=False)
    _c1_gemm: float = dataclasses.field(init=False, repr=False, compare=False)
    _c4_gemm: float = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Per-instance constants, computed once: the simulator calls the stage functions per step.
        c, cfg, tp = self.coeffs, self.cfg, self.tp
        layers = math.ceil(cfg.num_layers / self.pp)
        weights = layer_gemm_macs(cfg, tp, 1)  # = weight elements of one layer shard
        per_byte = c.allreduce_s_per_byte or 1.0 / self.link_bandwidth
        ar_per_token = allreduce_bytes_per_device(cfg, tp, 1) * per_byte  # one all-reduce, one token
        ar_fixed = 2 * (tp - 1) * self.link_latency_s if tp > 1 else 0.0
        object.__setattr__(self, "_layers", layers)
        object.__setattr__(self, "_weights", weights)
        object.__setattr__(self, "_ar_per_token", ar_per_token)
        object.__setattr__(self, "_ar_fixed", ar_fixed)
        factor, q_width = attention_factor(cfg, tp), cfg.num_heads * cfg.head_dim / tp  # OPT: 3, h/tp
        object.__setattr__(self, "_attn_prefill", c.C2 * factor * q_width / c.attention_tile)
        object.__setattr__(self, "_attn_decode", layers * c.C5 * factor * q_width)
        object.__setattr__(self, "_lm_head", cfg.vocab_size * cfg.embed_dim / tp / self.pp)
        object.__setattr__(self, "_decode_overhead", (c.C3 if c.C6 is None else c.C6) / self.pp)
        object.__setattr__(self, "_send_bytes_per_token", cfg.hidden_size * cfg.dtype_bytes)
        # x / 1.0 and x * 1.0 are x: at the checkpoint's precision every term is the product it was before
        object.__setattr__(self, "_c1_gemm", c.C1 / self.gemm_speedup)
        object.__setattr__(self, "_c4_gemm", c.C4 * self.gemm_bytes_ratio)

    def _allreduce_s(self, num_tokens: float) -> float:
        return 2 * (self._ar_per_token * num_tokens + self._ar_fixed)  # two all-reduces a layer

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float:
        c = self.coeffs
        per_layer = (
            self._c1_gemm * self._weights * num_tokens + self._attn_prefill * sum_sq + self._allreduce_s(num_tokens)
        )
        return self._layers * per_layer + c.C1 * self._lm_head * batch + c.C3 / self.pp

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float:
        return self.decode_stage_fn(batch)(ctx_sum)

    def decode_stage_fn(self, batch: int) -> Callable[[float], float]:
        """`decode_stage_s(batch, ·)`: the terms that do not depend on the context computed once."""
        c = self.coeffs
        per_elem = max(self._c4_gemm, self._c1_gemm * batch)  # reading a weight, or its multiply-adds
        layers = self._layers * (per_elem * self._weights + self._allreduce_s(batch))
        head = max(c.C4, c.C1 * batch)  # the LM head stays at the checkpoint's precision
        attn, lm_head, overhead = self._attn_decode, head * self._lm_head, self._decode_overhead
        return lambda ctx_sum: layers + attn * ctx_sum + lm_head + overhead

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float:
        # Decodes ride along as one token each in the GEMMs; their attention reads their cached context.
        attn_decode = self._attn_decode * decode_ctx_sum
        return self.prefill_stage_s(num_tokens + decode_batch, sum_sq, batch + decode_batch) + attn_decode

    def send_s(self, num_tokens: int) -> float:
        return self.link_latency_s + num_tokens * self._send_bytes_per_token / self.stage_link_bandwidth


@dataclasses.dataclass(frozen=True)
class FoldedCoefficients:
    """The artifact's folded form for one (engine, model, tp), milliseconds."""

    prefill: tuple[float, float, float]
    decode_small: tuple[float, float, float]
    decode_large: tuple[float, float, float]
    decode_batch_split: int = 95
    prefill_tokens: int | None = None  # L_m
    max_batch_tokens: int | None = None  # the engine's token cap per prefill step
    overhead: StepOverhead | None = None


@dataclasses.dataclass(frozen=True)
class FoldedModel:
    """Folded coefficients, with a pp-stage pipeline as 1/pp of the whole-model time per stage."""

    cfg: ModelConfig
    coeffs: FoldedCoefficients
    pp: int
    stage_link_bandwidth: float
    link_latency_s: float = 10e-6

    def prefill_stage_s(self, num_tokens: float, sum_sq: float, batch: int) -> float:
        a, b, c = self.coeffs.prefill
        return (a + b * num_tokens + c * sum_sq) / 1000.0 / self.pp

    def decode_stage_s(self, batch: int, ctx_sum: float) -> float:
        return self.decode_stage_fn(batch)(ctx_sum)

    def decode_stage_fn(self, batch: int) -> Callable[[float], float]:
        """`decode_stage_s(batch, ·)`: the terms that do not depend on the context computed once."""
        a, b, c = self.coeffs.decode_small if batch < self.coeffs.decode_batch_split else self.coeffs.decode_large
        per_batch, pp = c * batch, self.pp
        return lambda ctx_sum: (a + b * ctx_sum + per_batch) / 1000.0 / pp

    def chunk_stage_s(
        self, num_tokens: float, sum_sq: float, batch: int, decode_batch: int, decode_ctx_sum: float
    ) -> float:
        # The artifact's convention for a mixed step: decodes count as one prefill token each; their
        # attention over the cached context is the decode model's per-context term.
        a, b, c = self.coeffs.prefill
        b_ctx = self.coeffs.decode_small[1]
        return (a + b * (num_tokens + decode_batch) + c * sum_sq + b_ctx * decode_ctx_sum) / 1000.0 / self.pp

    def send_s(self, num_tokens: int) -> float:
        return (
            self.link_latency_s + num_tokens * self.cfg.hidden_size * self.cfg.dtype_bytes / self.stage_link_bandwidth
        )


# ---------------------------------------------------------------------------------------------
# Profiles and providers
# ---------------------------------------------------------------------------------------------
class ProfileError(ValueError):
    """A profile file that cannot be used; the message says why."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """Coefficients per (engine, model, tp) loaded from a profile file."""

    name: str
    device: str | None
    folded: dict[tuple[str, str, int], FoldedCoefficients]
    appendix: dict[tuple[str, str, int], AppendixCoefficients]
    # Entries fitted in the engine's padded shapes (`engine_padding`, see placement/padding.py): the
    # coefficients are per padded element, so instances built from them charge the padded batch.
    padding: dict[tuple[str, str, int], EnginePadding] = dataclasses.field(default_factory=dict)
    # The limits the profiled engines ran with, by engine kind (`engine_limits`): running sequences a decode /
    # colocated instance holds (`max_decode_batch`); what the measurements and the planning assume of them.
    decode_batch: dict[str, int] = dataclasses.field(default_factory=dict)
    limits_source: str | None = None  # where those limits come from (a script, a command line)
    # Entries fitted at a precision (`"quantization": "int8"` in the entry), by (engine, model, tp, quantization);
    # the entries above are the checkpoint's own precision, which the others are derived from where missing.
    quantized: dict[tuple[str, str, int, str], FoldedCoefficients | AppendixCoefficients] = dataclasses.field(
        default_factory=dict
    )
    quantized_padding: dict[tuple[str, str, int, str], EnginePadding] = dataclasses.field(default_factory=dict)

    def lookup_quantized(
        self, engine: DeploymentKind, model: str, tp: int, quantization: str
    ) -> tuple[FoldedCoefficients | AppendixCoefficients, EnginePadding | None] | None:
        """The coefficients fitted at `quantization` (exact engine first, then `any`) and the engine padding they
        were fitted in; None: none fitted."""
        for key in ((engine, model, tp, quantization), ("any", model, tp, quantization)):
            if key in self.quantized:
                return self.quantized[key], self.quantized_padding.get(key)
        return None

    def max_decode_batch(self, engine: DeploymentKind) -> int | None:
        """The decode batch cap the profiled `engine` ran with (None: the profile does not say)."""
        return self.decode_batch.get(engine)

    def padding_of(self, engine: DeploymentKind, model: str, tp: int) -> EnginePadding | None:
        for key in ((engine, model, tp), ("any", model, tp)):
            if key in self.folded or key in self.appendix:
                return self.padding.get(key)
        return None

    def lookup(self, engine: DeploymentKind, model: str, tp: int) -> FoldedCoefficients | AppendixCoefficients | None:
        for key in ((engine, model, tp), ("any", model, tp)):
            if key in self.folded:
                return self.folded[key]
            if key in self.appendix:
                return self.appendix[key]
        return None

    def supported_tps(self, engine: DeploymentKind, model: str) -> list[int]:
        keys = list(self.folded) + list(self.appendix)
        return sorted({tp for (e, m, tp) in keys if m == model and e in (engine, "any")})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Profile:
        if not isinstance(raw, dict) or not isinstance(raw.get("entries"), list):
            raise ProfileError("a profile is a JSON object with an 'entries' list")
        split = int(raw.get("decode_batch_split", 95))
        folded: dict[tuple[str, str, int], FoldedCoefficients] = {}
        appendix: dict[tuple[str, str, int], AppendixCoefficients] = {}
        padding: dict[tuple[str, str, int], EnginePadding] = {}
        quantized: dict[tuple[str, str, int, str], FoldedCoefficients | AppendixCoefficients] = {}
        quantized_padding: dict[tuple[str, str, int, str], EnginePadding] = {}
        for i, entry in enumerate(raw["entries"]):
            try:
                engine = str(entry.get("engine", "any"))
                engine = _KIND_ALIASES.get(engine, engine)
                if engine not in ("disagg", "colocated", "any"):
                    raise ProfileError(f"entry {i}: engine must be disagg, colocated or any, got {engine!r}")
                key = (engine, str(entry["model"]).lower(), int(entry["tp"]))
                lm = int(entry["L_m"]) if entry.get("L_m") is not None else None
                cap = int(entry["max_batch_tokens"]) if entry.get("max_batch_tokens") is not None else None
                overhead = (
                    StepOverhead(*(float(v) for v in _triple(entry["step_overhead"])))
                    if entry.get("step_overhead") is not None
                    else None
                )
                coeffs: FoldedCoefficients | AppendixCoefficients
                if "prefill" in entry:
                    coeffs = FoldedCoefficients(
                        prefill=_triple(entry["prefill"]),
                        decode_small=_triple(entry["decode_small"]),
                        decode_large=_triple(entry.get("decode_large", entry["decode_small"])),
                        decode_batch_split=split,
                        prefill_tokens=lm,
                        max_batch_tokens=cap,
                        overhead=overhead,
                    )
                elif "C1" in entry:
                    coeffs = AppendixCoefficients(
                        C1=float(entry["C1"]),
                        C2=float(entry["C2"]),
                        C3=float(entry["C3"]),
                        C4=float(entry["C4"]),
                        C5=float(entry["C5"]),
                        C6=float(entry["C6"]) if entry.get("C6") is not None else None,
                        # "block_size": the key profiles written before the tile got its own name used
                        attention_tile=int(
                            entry.get("attention_tile", entry.get("block_size", DEFAULT_ATTENTION_TILE))
                        ),
                        allreduce_s_per_byte=(
                            float(entry["allreduce_s_per_byte"])
                            if entry.get("allreduce_s_per_byte") is not None
                            else None
                        ),
                        prefill_tokens=lm,
                        max_batch_tokens=cap,
                        overhead=overhead,
                        buckets=(
                            BucketCosts.from_dict(entry["bucket_costs"])
                            if entry.get("bucket_costs") is not None
                            else None
                        ),
                    )
                else:
                    raise ProfileError(f"entry {i}: needs either prefill/decode_small/decode_large or C1..C5")
                quantization = entry.get("quantization")
                if quantization is not None:  # fitted at a precision: beside the checkpoint's entry, not over it
                    if quantization not in QUANTIZATIONS:
                        raise ProfileError(
                            f"entry {i}: unknown quantization {quantization!r}; expected one of {QUANTIZATIONS}"
                        )
                    quantized[(*key, quantization)] = coeffs
                    if entry.get("engine_padding") is not None:
                        quantized_padding[(*key, quantization)] = _engine_padding(i, entry["engine_padding"])
                    continue
                if isinstance(coeffs, FoldedCoefficients):
                    folded[key] = coeffs
                else:
                    appendix[key] = coeffs
                if entry.get("engine_padding") is not None:
                    padding[key] = _engine_padding(i, entry["engine_padding"])
            except (KeyError, TypeError, ValueError) as e:
                if isinstance(e, ProfileError):
                    raise
                raise ProfileError(f"profile entry {i} is malformed: {e}") from None
        decode_batch, limits_source = _engine_limits(raw.get("engine_limits"))
        return cls(
            name=str(raw.get("name", "profile")),
            device=raw.get("device"),
            folded=folded,
            appendix=appendix,
            padding=padding,
            decode_batch=decode_batch,
            limits_source=limits_source,
            quantized=quantized,
            quantized_padding=quantized_padding,
        )


def _engine_padding(i: int, pad: object) -> EnginePadding:
    known = {f.name for f in dataclasses.fields(EnginePadding)}
    if not isinstance(pad, dict) or set(pad) - known:
        raise ProfileError(f"entry {i}: engine_padding takes only {sorted(known)}")
    bools = {f.name for f in dataclasses.fields(EnginePadding) if f.type in ("bool", bool)}
    values: dict[str, Any] = {k: bool(v) if k in bools else int(v) for k, v in pad.items()}
    return EnginePadding(**values)


def _engine_limits(raw: object) -> tuple[dict[str, int], str | None]:
    """`engine_limits`: {"disagg": {"max_decode_batch": N}, "colocated": {...}, "source": "..."} (all optional)."""
    if raw is None:
        return {}, None
    if not isinstance(raw, dict):
        raise ProfileError("engine_limits must be an object of engine kinds")
    caps: dict[str, int] = {}
    for engine, limits in raw.items():
        if engine == "source":
            continue
        kind = _KIND_ALIASES.get(engine, engine)
        if kind not in ("disagg", "colocated") or not isinstance(limits, dict) or set(limits) - {"max_decode_batch"}:
            raise ProfileError(
                f"engine_limits.{engine}: engine kinds are disagg and colocated, each with only max_decode_batch"
            )
        value = limits.get("max_decode_batch")
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProfileError(f"engine_limits.{engine}.max_decode_batch must be an integer >= 1, got {value!r}")
            caps[kind] = value
    source = raw.get("source")
    return caps, str(source) if source is not None else None


def _triple(value: Sequence[float]) -> tuple[float, float, float]:
    if len(value) != 3:
        raise ProfileError(f"expected three coefficients [a, b, c], got {value!r}")
    return float(value[0]), float(value[1]), float(value[2])


def builtin_profiles() -> list[str]:
    folder = resources.files("placement") / "profiles"
    return sorted(p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (`a100-80gb-distserve`) or a JSON file path."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise ProfileError(f"profile file {name_or_path!r} does not exist")
        text = path.read_text()
    else:
        resource = resources.files("placement") / "profiles" / f"{name_or_path}.json"
        if not resource.is_file():
            raise ProfileError(f"unknown profile {name_or_path!r}; built-in: {', '.join(builtin_profiles())}")
        text = resource.read_text()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"profile {name_or_path!r} is not valid JSON: {e}") from None
    return Profile.from_dict(raw)


@dataclasses.dataclass(frozen=True)
class LatencyProvider:
    """Builds instance latency models for one model on one device, from a profile or the roofline."""

    cfg: ModelConfig
    device: DeviceSpec
    profile: Profile | None = None
    intra_node_bandwidth: float | None = None
    prefill_tokens: int | None = None  # override of L_m

    @property
    def model_name(self) -> str:
        return self.cfg.name.lower()

    def supports(self, engine: DeploymentKind, tp: int) -> bool:
        return self.profile is None or self.profile.lookup(engine, self.model_name, tp) is not None

    def instance(
        self,
        engine: DeploymentKind,
        tp: int,
        pp: int,
        stage_link_bandwidth: float | None = None,
        quantization: str | None = None,
    ) -> StageLatency:
        """The latency model of one instance; `stage_link_bandwidth` is the link between adjacent stages.

        An entry fitted in the engine's padded shapes (`engine_padding`) gives a model that pads each
        batch the way the engine does before applying the coefficients. At a `quantization` (None: the
        checkpoint's precision) the roofline takes its bytes and matmul rate; a profile gives the entry fitted
        at it, else its checkpoint entry carried over by the roofline (`precision_source` says which).
        """
        link = self.intra_node_bandwidth or self.device.link_bandwidth
        stage_link = stage_link_bandwidth or link
        if self.profile is None:
            return self._roofline(tp, pp, link, stage_link, quantization)
        if quantization is not None:
            fitted = self.profile.lookup_quantized(engine, self.model_name, tp, quantization)
            if fitted is not None:
                model = self._from_coeffs(fitted[0], tp, pp, link, stage_link)
                return model if fitted[1] is None else PaddedModel(model, fitted[1])
            return RooflineRatio(
                self.instance(engine, tp, pp, stage_link_bandwidth),
                self._roofline(tp, pp, link, stage_link, quantization),
                self._roofline(tp, pp, link, stage_link, None),
            )
        coeffs = self.profile.lookup(engine, self.model_name, tp)
        if coeffs is None:
            raise ProfileError(
                f"profile {self.profile.name!r} has no {engine} coefficients for {self.model_name} tp{tp}; "
                f"it has tp {self.profile.supported_tps(engine, self.model_name)}"
            )
        base = self._from_coeffs(coeffs, tp, pp, link, stage_link)
        pad = self.profile.padding_of(engine, self.model_name, tp)
        if pad is None:
            return base
        return PaddedModel(base, pad)

    def _roofline(self, tp: int, pp: int, link: float, stage_link: float, quantization: str | None) -> AppendixModel:
        coeffs = AppendixCoefficients.roofline(self.device, self.cfg.dtype_bytes)
        if quantization is None:
            return AppendixModel(self.cfg, coeffs, tp, pp, link, stage_link)
        speedup = matmul_speedup(quantization, self.device)
        ratio = precision_weight_bytes(quantization, self.cfg.dtype_bytes) / self.cfg.dtype_bytes
        return AppendixModel(self.cfg, coeffs, tp, pp, link, stage_link, gemm_speedup=speedup, gemm_bytes_ratio=ratio)

    def _from_coeffs(
        self, coeffs: FoldedCoefficients | AppendixCoefficients, tp: int, pp: int, link: float, stage_link: float
    ) -> AppendixModel | FoldedModel | BucketModel:
        if isinstance(coeffs, FoldedCoefficients):
            return FoldedModel(self.cfg, coeffs, pp, stage_link)
        base = AppendixModel(self.cfg, coeffs, tp, pp, link, stage_link)
        if coeffs.buckets is None:
            return base
        b = coeffs.buckets
        cfg = self.cfg  # L·3(h/tp) for OPT, as the Appendix form
        width = attention_factor(cfg, tp) * cfg.num_layers * (cfg.num_heads * cfg.head_dim) / tp
        return BucketModel(b, b.C2 * width / coeffs.attention_tile, b.C5 * width, base.send_s, pp)

    def precision_source(self, engine: DeploymentKind, tp: int, quantization: str | None) -> str:
        """Where an instance's latency at `quantization` comes from, for the planner's report."""
        if self.profile is None:
            return "roofline"
        if quantization is None:
            return f"profile {self.profile.name}"
        if self.profile.lookup_quantized(engine, self.model_name, tp, quantization) is not None:
            return f"profile {self.profile.name}, fitted at {quantization}"
        return f"profile {self.profile.name} at the checkpoint's precision x the roofline's {quantization} ratio"

    def engine_token_cap(self, engine: DeploymentKind, tp: int) -> int:
        """The most prompt tokens the engine batches in one prefill step: the profile's cap, else the default limit."""
        cap = self.profile_token_cap(engine, tp)
        return cap if cap is not None else DEFAULT_LIMITS.max_batch_tokens

    def profile_decode_batch(self, engine: DeploymentKind) -> int | None:
        """The decode batch cap the profile's `engine` ran with (None: no profile, or it does not say)."""
        return self.profile.max_decode_batch(engine) if self.profile is not None else None

    def profile_token_cap(self, engine: DeploymentKind, tp: int) -> int | None:
        """The token cap of a prefill step the profile measured its engine with (None: it says none)."""
        if self.profile is not None:
            coeffs = self.profile.lookup(engine, self.model_name, tp)
            if coeffs is not None and coeffs.max_batch_tokens is not None:
                return coeffs.max_batch_tokens
        return None

    def step_overhead(self, engine: DeploymentKind, tp: int, quantization: str | None = None) -> StepOverhead:
        """Host time per step (the profile's `step_overhead`; none without one): the entry fitted at `quantization`
        where the profile has one, else the checkpoint precision's (host work does not depend on the weights)."""
        if self.profile is not None:
            fitted = self.profile.lookup_quantized(engine, self.model_name, tp, quantization) if quantization else None
            coeffs = fitted[0] if fitted is not None else self.profile.lookup(engine, self.model_name, tp)
            if coeffs is not None and coeffs.overhead is not None:
                return coeffs.overhead
        return NO_OVERHEAD

    def prefill_token_budget(self, engine: DeploymentKind, tp: int) -> int:
        """L_m: the prefill batch token budget."""
        if self.prefill_tokens is not None:
            return self.prefill_tokens
        if self.profile is not None:
            coeffs = self.profile.lookup(engine, self.model_name, tp)
            if coeffs is not None and coeffs.prefill_tokens is not None:
                return coeffs.prefill_tokens
        return DEFAULT_PREFILL_TOKENS
