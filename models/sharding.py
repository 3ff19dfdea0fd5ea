"""Tensor- and pipeline-parallel layout of OPT and Llama-style decoders, and a sharded model that runs them.

Tensor parallelism (mesh axis `tp`): attention heads and FFN columns are split — q/k/v and fc1
are column-parallel (kernel `[L, in, out]` split on `out`), out_proj and fc2 row-parallel (split on
`in`); XLA inserts the all-reduce after the row-parallel matmuls. Embeddings, position table,
LayerNorms, the row-parallel biases and the tied LM head are replicated on every device of a
stage (simple, and the LM head's all-gather of vocab logits would cost more than it saves at the
sizes we serve on one host). The KV cache is split over heads.

Llama-style (`models.llama`): q/k/v and gate/up are column-parallel, o_proj and down_proj
row-parallel, RMSNorm scales and the head replicated. Query heads split over `tp`; K/V heads split
too where `tp` divides them, and where `tp` is a multiple of them every device holds all K/V heads
(k/v projections and the cache replicated; each device's query heads read the K/V head of their
group). Any other `tp` is refused with the reason. No family file names a mesh axis: each parameter carries
logical axis names (`models.layers`) and `LOGICAL_AXIS_RULES` here, the one table, maps them onto a stage's
mesh (`mesh_rules`: the K/V heads' row follows tp); this module builds the meshes and places by them.

Pipeline parallelism: `pp` contiguous, equal layer ranges; stage s runs on its own 1-D mesh over
devices `[s*tp, (s+1)*tp)` (devices are stage-major). Activations move between stages with
`jax.device_put`; nothing blocks, so dispatch stays asynchronous. The first stage holds the
embeddings, the last the final LayerNorm/`project_out` and a copy of `embed_tokens` for the
tied LM head.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Self

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import checkpoint, decoder
from models import params as module_params
from models.attention import KVCache, PagedKVCache, paged_cache_shape
from models.config import LlamaConfig, ModelConfig, OPTConfig, UnsupportedModelError, kv_heads_split, tp_problems
from models.decoder import Params
from models.families import FAMILIES
from models.layers import Stage
from models.paged_attention import BLOCK_LAYOUTS, BlockLayout, Impl, block_layout_for, default_impl, stage_impl
from models.quant import QuantizedWeight
from models.quantize import (
    QuantizationError,
    StageWeights,
    WeightMaker,
    check_quantization,
    is_quantized,
    quantize_state,
    requantized_weights,
    stage_weights,
)

log = logging.getLogger(__name__)

# A stage's module state as the jitted steps take it: `nnx.to_pure_dict`'s nested dict of arrays (`stage_module`).
StageState = dict[Any, Any]


# The mesh axis tensor parallelism splits over (a stage's 1-D mesh, `make_mesh`).
TP_AXIS = "tp"

# THE table: each logical axis name a parameter carries (`models.layers`) -> the mesh axis it is split over
# (None: replicated on every device of the stage). Query heads, K/V heads and the FFN width are split over tp
# (column-parallel q/k/v, gate/up, fc1 and their biases; row-parallel o/out_proj, down/fc2); embeddings, the
# hidden width (norms, row-parallel biases, added after the all-reduce) and the tied head are replicated.
# A phase's mesh changes the mapping (`mesh_rules`), never the model code.
LOGICAL_AXIS_RULES: dict[str, str | None] = {
    "vocab": None,
    "embed": None,
    "positions": None,
    "heads": TP_AXIS,
    "kv_heads": TP_AXIS,
    "mlp": TP_AXIS,
    "fused": None,  # fused projections live only on one-device stages
}


def mesh_rules(kv_split: bool) -> dict[str, str | None]:
    """The rules of one phase's mesh: K/V heads split where tp divides them, replicated where tp is a multiple
    of them (every device then holds all K/V heads; its query heads read their group's)."""
    return LOGICAL_AXIS_RULES if kv_split else {**LOGICAL_AXIS_RULES, "kv_heads": None}


def spec_of(axes: Sequence[str | None], rules: dict[str, str | None]) -> P:
    """The PartitionSpec of a parameter with logical `axes` under `rules` (`P()` when nothing is split)."""
    mesh_axes = tuple(None if a is None else rules[a] for a in axes)
    return P(*mesh_axes) if any(m is not None for m in mesh_axes) else P()


# [L, B, T, H, D] and [L, num_blocks, block_size, H, D]: heads split.
KV_SPEC = P(None, None, None, TP_AXIS, None)
# [L, num_blocks, H, block_size, D] (a pool of head-major blocks): heads split.
HEADS_POOL_SPEC = P(None, None, TP_AXIS, None, None)


def pool_spec(block_layout: BlockLayout, kv_split: bool = True) -> P:
    """PartitionSpec of a block pool's K / V in `block_layout` (heads over `tp` either way; `kv_split=False`: replicated)."""
    if not kv_split:
        return P()
    return HEADS_POOL_SPEC if block_layout == "heads" else KV_SPEC


# Each config type's family module: its layers, params and partition specs, and the shared skeleton
# (`models.decoder`) bound to them (docs/models.md, "Adding a family").
def validate_parallelism(cfg: ModelConfig, tp: int, pp: int, num_devices: int | None = None) -> None:
    """Raise a ValueError that says what is wrong when `cfg` cannot be split `tp` x `pp` ways (the tp rule is
    `models.config.tp_problems`, the planner's too)."""
    problems = []
    if tp < 1 or pp < 1:
        problems.append(f"tp and pp must be >= 1 (got tp={tp}, pp={pp})")
    else:
        problems += tp_problems(cfg, tp)
        if cfg.num_layers % pp:
            problems.append(f"num_layers {cfg.num_layers} is not divisible by pp={pp}")
        if num_devices is not None and num_devices != tp * pp:
            problems.append(f"tp*pp = {tp * pp} devices needed, got {num_devices}")
    if problems:
        raise ValueError(f"cannot shard {cfg.name} with tp={tp}, pp={pp}: " + "; ".join(problems))


def stage_layer_ranges(cfg: ModelConfig, pp: int) -> list[tuple[int, int]]:
    """Contiguous `[start, end)` layer ranges of the `pp` pipeline stages."""
    if pp < 1 or cfg.num_layers % pp:
        raise ValueError(f"num_layers {cfg.num_layers} is not divisible by pp={pp}")
    n = cfg.num_layers // pp
    return [(s * n, (s + 1) * n) for s in range(pp)]


def param_specs(cfg: ModelConfig, first: bool = True, last: bool = True, tp: int = 1) -> dict[str, Any]:
    """PartitionSpecs of a stage's checkpoint-layout param tree (`models.params`: layer leaves stacked `[L, ...]`),
    from its parameters' logical axes under the stage mesh's rules; the loaders place by these."""
    rules = mesh_rules(kv_heads_split(cfg, tp))
    _, abstract_state = module_params.abstract(cfg, Stage(num_layers=1, first=first, last=last))
    specs: dict[str, Any] = {}
    for path, axes in module_params.logical_axes(abstract_state).items():
        key, layer = module_params.checkpoint_path(path)
        node = specs
        for p in key[:-1]:
            node = node.setdefault(p, {})
        node[key[-1]] = spec_of((None, *axes) if layer is not None else axes, rules)
    return specs


def _state_shardings(abstract_state: nnx.State, mesh: Mesh, rules: dict[str, str | None]) -> dict[Any, Any]:
    """The NamedSharding of every parameter of a module state (a pure dict, as `nnx.to_pure_dict` writes)."""
    out: dict[Any, Any] = {}
    for path, axes in module_params.logical_axes(abstract_state).items():
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = NamedSharding(mesh, spec_of(axes, rules))
    return out


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """One pipeline stage: its layers, devices, mesh and shardings."""

    index: int
    layers: tuple[int, int]  # [start, end)
    mesh: Mesh
    param_shardings: dict[str, Any]  # NamedSharding tree matching opt.stage_params
    kv_sharding: NamedSharding  # for [L_stage, B, T, KVH, D] / [L_stage, N, bs, KVH, D]
    replicated: NamedSharding
    kv_split: bool = True  # K/V heads split over tp (False: every device holds all of them)

    def pool_sharding(self, block_layout: BlockLayout) -> NamedSharding:
        """The sharding of this stage's block pool in `block_layout`."""
        return NamedSharding(self.mesh, pool_spec(block_layout, self.kv_split))

    @property
    def first(self) -> bool:
        return self.layers[0] == 0

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    cfg: ModelConfig
    tp: int
    pp: int
    stages: tuple[StageLayout, ...]

    @property
    def meshes(self) -> list[Mesh]:
        return [s.mesh for s in self.stages]


def make_mesh(devices: Sequence[jax.Device]) -> Mesh:
    """A 1-D `tp` mesh with Auto axis type (jax.make_mesh would default to Explicit on 0.10)."""
    return Mesh(np.array(list(devices)), (TP_AXIS,))


def shardings_for(cfg: ModelConfig, tp: int, pp: int, devices: Sequence[jax.Device]) -> ParallelLayout:
    """Meshes and NamedShardings of every stage; `devices` are stage-major (first `tp` = stage 0)."""
    devices = list(devices)
    validate_parallelism(cfg, tp, pp, len(devices))
    kv_split = kv_heads_split(cfg, tp)
    stages = []
    for s, (start, end) in enumerate(stage_layer_ranges(cfg, pp)):
        mesh = make_mesh(devices[s * tp : (s + 1) * tp])
        specs = param_specs(cfg, first=start == 0, last=end == cfg.num_layers, tp=tp)
        shardings = jax.tree.map(lambda spec, m=mesh: NamedSharding(m, spec), specs, is_leaf=lambda x: isinstance(x, P))
        stages.append(
            StageLayout(
                index=s,
                layers=(start, end),
                mesh=mesh,
                param_shardings=shardings,
                kv_sharding=NamedSharding(mesh, KV_SPEC if kv_split else P()),
                replicated=NamedSharding(mesh, P()),
                kv_split=kv_split,
            )
        )
    return ParallelLayout(cfg=cfg, tp=tp, pp=pp, stages=tuple(stages))


def fuses_projections(st: StageLayout) -> bool:
    """Whether a stage serves with its projections fused (`models.layers.add_projections`): only on one device."""
    return bool(st.mesh.devices.size == 1)


def stage_module(
    cfg: ModelConfig, st: StageLayout, sp: Params, weights: WeightMaker | None = None
) -> tuple[nnx.GraphDef[Any], StageState]:
    """A stage's model split into (graph, state): the state built from its checkpoint-layout params `sp` (already
    placed by the loaders) by one jitted program whose outputs land on the shardings the parameters' logical
    axes give under this stage's rules. The graph is static; the state is the pytree the jitted steps take.
    With `weights` (`models.quantize`), the weights it quantizes are then swapped for their quantized form.

    The state is kept as a pure dict of arrays (`nnx.to_pure_dict`'s form; `nnx.merge` takes it as it is): a
    jitted call flattens its arguments every step, and an `nnx.State` of Variables flattens ~6x slower than
    plain dicts (0.6 ms against 0.1 ms for opt-125m on the loaded 2-core machine: 5 % of a decode step).
    """
    stage = Stage(st.num_layers, first=st.first, last=st.layers[1] == cfg.num_layers, fused=fuses_projections(st))
    graphdef, state = module_params.abstract(cfg, stage, jax.tree.leaves(sp)[0].dtype)
    shardings = _state_shardings(state, st.mesh, mesh_rules(st.kv_split))
    build = jax.jit(partial(module_params.state_from_params, state), out_shardings=shardings)
    built = build(sp)
    if weights is not None:
        built = quantize_state(built, shardings, weights)
    return graphdef, built


class ShardedModel:
    """A model's params (OPT or Llama-style) placed `tp` x `pp` ways, with prefill / decode / paged-extend
    across the stages; `ShardedOPT` and `ShardedLlama` are it for one family each.

    Every method returns without waiting for the devices (async dispatch). Caches are lists with
    one entry per stage, each on that stage's mesh and split over K/V heads (or replicated, when
    tp is a multiple of a Llama-style model's K/V heads).

    Each stage is the family's `flax.nnx` model holding that stage's layers, split (`stage_module`): the
    graph (`graphdefs[s]`) is static, the state (`run_params[s]`) is the pytree every jitted step takes and
    merges back (trace-time only). The state keeps one sub-tree per layer, so the unrolled per-layer program
    reads each weight in place (slices of stacked leaves are copies on XLA:CPU); on a one-device stage each
    layer's q/k/v (and a Llama-style gate/up) are one fused kernel (`models.layers.add_projections`).
    `stage_params` gives the checkpoint layout (stacked, unfused; a copy) for checkpoints and tools.
    """

    # The configs this class serves (a subclass narrows it to its family).
    config_types: tuple[type, ...] = tuple(FAMILIES)

    def __init__(
        self,
        cfg: ModelConfig,
        tp: int,
        pp: int,
        layout: ParallelLayout,
        stage_params: list[Params],
        weights: StageWeights | None = None,
    ) -> None:
        _check_config(type(self), cfg)
        self.cfg = cfg
        self.tp = tp
        self.pp = pp
        self.layout = layout
        # Each stage's model split (`stage_module`): the graph static, the state what the jitted steps take;
        # `weights` (`models.quantize.stage_weights`) gives each stage's quantized weights, if any.
        split = [
            stage_module(cfg, st, sp, None if weights is None else weights(st.layers[0]))
            for sp, st in zip(stage_params, layout.stages, strict=True)
        ]
        self.graphdefs: list[nnx.GraphDef[Any]] = [graphdef for graphdef, _ in split]
        self.run_params: list[StageState] = [state for _, state in split]
        self._fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
        # Paged-step executables compiled ahead of time (`precompile_paged`), by stage, flags and shapes; a
        # step of that shape runs them instead of the jitted function (which would compile it again).
        self._executables: dict[tuple[Any, ...], Any] = {}
        # paged decode attention (models.paged_attention); set before the first step compiles. Not waiting for
        # the CPU kernel's build: the first paged step's trace does (loading and prefill compiles go on meanwhile)
        self.attention_impl: Impl = default_impl(wait=False)
        self._block_layout: BlockLayout | None = None  # None: block_layout_for(attention_impl)

    # ---- construction ----------------------------------------------------------------------
    @property
    def meshes(self) -> list[Mesh]:
        return self.layout.meshes

    @property
    def dtype(self) -> jnp.dtype:
        """The float dtype of the weights and activations (a quantized weight's integers are not it)."""
        leaves = jax.tree.leaves(self.run_params[0], is_leaf=lambda x: isinstance(x, QuantizedWeight))
        return jnp.dtype(next(x for x in leaves if not isinstance(x, QuantizedWeight)).dtype)

    @property
    def quantized(self) -> bool:
        """Whether any stage serves quantized weights (`models.quantize`)."""
        return any(is_quantized(rp) for rp in self.run_params)

    @property
    def devices(self) -> list[jax.Device]:
        return [d for m in self.meshes for d in m.devices.flat]

    @property
    def stage_params(self) -> list[Params]:
        """Each stage's params with stacked layer leaves `[L_s, ...]` (a copy; the layout checkpoints use)."""
        if self.quantized:
            raise QuantizationError(
                "the checkpoint layout holds float weights; this model serves quantized ones (load it again from "
                "its source, at the same quantization)"
            )
        out = []
        for rp, st in zip(self.run_params, self.layout.stages, strict=True):
            stack = jax.jit(partial(module_params.params_from_state, self.cfg), out_shardings=st.param_shardings)
            out.append(stack(rp))
        return out

    @classmethod
    def from_params(
        cls,
        cfg: ModelConfig,
        params: Params,
        tp: int,
        pp: int,
        devices: Sequence[jax.Device],
        dtype: Any = None,
        quantization: str | None = None,
    ) -> Self:
        """Place a full param tree (host numpy or jax arrays) stage by stage, shard by shard; at `quantization`
        ("int8" / "int4", `models.quantize`) if given."""
        _check_config(cls, cfg)
        check_quantization(quantization, gguf=False)
        layout = shardings_for(cfg, tp, pp, devices)
        dt = jnp.dtype(dtype) if dtype is not None else jnp.dtype(params["embed_tokens"].dtype)
        placed = checkpoint.place_params(checkpoint.ParamTreeReader(params), cfg, layout, dt)
        weights = None if quantization is None else (lambda _start: requantized_weights(quantization))
        return cls(cfg, tp, pp, layout, placed, weights)

    @classmethod
    def load(
        cls,
        source: str | Path,
        tp: int,
        pp: int,
        devices: Sequence[jax.Device],
        dtype: Any = "float32",
        seed: int = 0,
        quantization: str | None = None,
    ) -> Self:
        """From a Hugging Face dir, a jaxserve (Orbax) checkpoint dir, a GGUF file (served as stored), or a preset
        name (random weights); at `quantization` (`models.quantize.QUANTIZATIONS`) if given."""
        cfg = checkpoint.source_config(source, dtype)
        _check_config(cls, cfg)  # before any weight is read
        weights = stage_weights(source, cfg, quantization)  # a bad quantization: one error, nothing read yet
        layout = shardings_for(cfg, tp, pp, devices)
        return cls(cfg, tp, pp, layout, checkpoint.load_stage_params(source, cfg, layout, dtype, seed=seed), weights)

    @property
    def block_layout(self) -> BlockLayout:
        """The layout `init_paged_caches` stores blocks in: the one `attention_impl` reads best, unless set.

        Each pool carries its own layout (`PagedKVCache.block_layout`) and the paged step follows
        the pool it is given, so this only decides what new pools look like.
        """
        return self._block_layout or block_layout_for(self.attention_impl)

    @block_layout.setter
    def block_layout(self, layout: BlockLayout | None) -> None:
        if layout not in (None, *BLOCK_LAYOUTS):
            raise ValueError(f"unknown block layout {layout!r}")
        self._block_layout = layout

    def stage_attention(self, stage: int) -> Impl:
        """The paged decode attention stage `stage` runs: `attention_impl`, except that a stage split over
        several devices runs "xla_heads_flat" in the CPU kernel's place (the kernel's call is not partitioned)."""
        return stage_impl(self.attention_impl, self.layout.stages[stage].mesh.devices.size)

    # ---- shardings -------------------------------------------------------------------------
    def kv_sharding(self, stage: int) -> NamedSharding:
        return self.layout.stages[stage].kv_sharding

    def replicated(self, stage: int) -> NamedSharding:
        return self.layout.stages[stage].replicated

    def _put(self, x: Any, stage: int) -> jax.Array:
        return jax.device_put(x, self.layout.stages[stage].replicated)

    def _fn(self, kind: str, stage: int, **static: Any) -> Callable[..., Any]:
        key = (kind, stage, *sorted(static.items()))
        fn = self._fns.get(key)
        if fn is None:
            st = self.layout.stages[stage]
            graphdef = self.graphdefs[stage]
            out = (st.replicated, st.kv_sharding)
            if kind == "prefill":
                fn = jax.jit(partial(_on_state, decoder.stage_prefill, graphdef, **static), out_shardings=out)
            elif kind == "decode":
                fn = jax.jit(partial(_on_state, decoder.stage_decode, graphdef), out_shardings=out, donate_argnums=(3,))
            elif kind == "paged":  # static carries the pool's block_layout
                fn = jax.jit(
                    partial(_on_state, decoder.stage_paged, graphdef, **static, attention=self.stage_attention(stage)),
                    out_shardings=(st.replicated, st.pool_sharding(static["block_layout"])),
                    donate_argnums=(4,),
                )
            else:
                raise ValueError(kind)
            self._fns[key] = fn
        return fn

    # ---- forward passes ----------------------------------------------------------------------
    def prefill(self, tokens: Any, lengths: Any, *, all_logits: bool = False) -> tuple[jax.Array, list[KVCache]]:
        """Right-padded prompts [B,T]; logits [B,V] (or [B,T,V]) on the last stage, one KVCache per stage."""
        x: Any = tokens
        caches = []
        for s in range(self.pp):
            key = ("prefill", s, all_logits, tuple(np.shape(x)))
            fn = self._executables.get(key) or self._fn("prefill", s, all_logits=all_logits)
            x, cache = fn(self.run_params[s], self._put(x, s), self._put(lengths, s))
            caches.append(cache)
        return x, caches

    def precompile_prefill(self, rows: int, tokens: int, *, all_logits: bool = False) -> None:
        """Compile, without running, every stage's prefill of `rows` x `tokens`; later `prefill` calls of that
        shape run these executables (a long bucket costs its compile, not a prefill of that length)."""
        x: Any = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
        for s in range(self.pp):
            key = ("prefill", s, all_logits, tuple(x.shape))
            st = self.layout.stages[s]
            if key not in self._executables:
                lowered = self._fn("prefill", s, all_logits=all_logits).lower(  # type: ignore[attr-defined]
                    self.run_params[s],
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=st.replicated),
                    jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=st.replicated),
                )
                self._executables[key] = lowered.compile()
            x = self._executables[key].out_info[0]

    def decode(self, tokens: Any, positions: Any, caches: list[KVCache]) -> tuple[jax.Array, list[KVCache]]:
        """tokens/positions [B]; the caches are donated."""
        x: Any = tokens
        out = []
        for s in range(self.pp):
            x, cache = self._fn("decode", s)(self.run_params[s], self._put(x, s), self._put(positions, s), caches[s])
            out.append(cache)
        return x, out

    def extend_paged(
        self,
        tokens: Any,
        start_positions: Any,
        lengths: Any,
        caches: list[PagedKVCache],
        block_tables: Any,
        *,
        all_logits: bool = False,
    ) -> tuple[jax.Array, list[PagedKVCache]]:
        """Append tokens [B,T] into the paged caches (donated); see `decoder.stage_paged`."""
        x: Any = tokens
        out = []
        for s in range(self.pp):
            layout = caches[s].block_layout
            key = _paged_key(s, all_logits, layout, np.shape(x), np.shape(block_tables), caches[s].k.shape)
            fn = self._executables.get(key) or self._fn("paged", s, all_logits=all_logits, block_layout=layout)
            x, cache = fn(
                self.run_params[s],
                self._put(x, s),
                self._put(start_positions, s),
                self._put(lengths, s),
                caches[s],
                self._put(block_tables, s),
            )
            out.append(cache)
        return x, out

    def precompile_paged(
        self, rows: int, tokens: int, table_width: int, caches: Sequence[PagedKVCache], *, all_logits: bool = False
    ) -> None:
        """Compile, without running, every stage's paged step of `rows` x `tokens` with `table_width`-wide block
        tables over pools shaped like `caches`; later `extend_paged` calls of that shape run these executables.

        Nothing is read or written: a server compiles more shapes this way on a background thread while its
        instances serve on the shapes already compiled (a compile that ran the step would need the pool, which
        the serving steps own and donate).
        """
        x: Any = jax.ShapeDtypeStruct((rows, tokens), jnp.int32)
        for s in range(self.pp):
            layout = caches[s].block_layout
            key = _paged_key(s, all_logits, layout, x.shape, (rows, table_width), caches[s].k.shape)
            if key in self._executables:
                x = self._executables[key].out_info[0]
                continue
            st = self.layout.stages[s]

            def abstract(shape: tuple[int, ...], dtype: Any, st: StageLayout = st) -> jax.ShapeDtypeStruct:
                return jax.ShapeDtypeStruct(shape, dtype, sharding=st.replicated)

            pool = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), caches[s])
            fn = self._fn("paged", s, all_logits=all_logits, block_layout=layout)
            lowered = fn.lower(  # type: ignore[attr-defined]
                self.run_params[s],
                abstract(x.shape, x.dtype),
                abstract((rows,), jnp.int32),
                abstract((rows,), jnp.int32),
                pool,
                abstract((rows, table_width), jnp.int32),
            )
            self._executables[key] = lowered.compile()
            x = lowered.out_info[0]

    # ---- caches ------------------------------------------------------------------------------
    def init_paged_caches(
        self, num_blocks: int, block_size: int, block_layout: BlockLayout | None = None
    ) -> list[PagedKVCache]:
        """Zeroed block pools, one per stage, split over heads, in `block_layout` (default: `self.block_layout`)."""
        layout = self.block_layout if block_layout is None else block_layout
        caches = []
        for st in self.layout.stages:
            shape = paged_cache_shape(self.cfg, num_blocks, block_size, layout, st.num_layers)
            zeros = jax.jit(partial(jnp.zeros, shape, self.dtype), out_shardings=st.pool_sharding(layout))
            caches.append(PagedKVCache(k=zeros(), v=zeros(), block_layout=layout))
        return caches

    def init_caches(self, batch_size: int, max_len: int) -> list[KVCache]:
        """Zeroed contiguous caches `[L_stage, B, max_len, H, D]`, one per stage."""
        caches = []
        for st in self.layout.stages:
            shape = (st.num_layers, batch_size, max_len, self.cfg.kv_heads, self.cfg.head_dim)
            zeros = jax.jit(partial(jnp.zeros, shape, self.dtype), out_shardings=st.kv_sharding)
            caches.append(KVCache(k=zeros(), v=zeros()))
        return caches

    def put_kv(self, kv: KVCache, stage: int) -> KVCache:
        """Move a KVCache (e.g. another instance's prefill output for this stage) onto this stage's mesh."""
        sh = self.kv_sharding(stage)
        return KVCache(k=jax.device_put(kv.k, sh), v=jax.device_put(kv.v, sh))


def _on_state(step: Callable[..., Any], graphdef: nnx.GraphDef[Any], state: StageState, *args: Any, **kw: Any) -> Any:
    """`step` (a `models.decoder` stage step) over the stage model merged from its static graph and its state."""
    return step(nnx.merge(graphdef, state), *args, **kw)


def _paged_key(
    stage: int, all_logits: bool, layout: BlockLayout, x_shape: Any, tables_shape: Any, pool_shape: Any
) -> tuple[Any, ...]:
    """A paged step's executable key: stage, flags, input shapes (stage > 0 takes activations, not token ids)."""
    return (stage, all_logits, layout, tuple(x_shape), tuple(tables_shape), tuple(pool_shape))


class ShardedOPT(ShardedModel):
    """A `ShardedModel` of an OPT model (what the runtime's engine serves today)."""

    cfg: OPTConfig
    config_types = (OPTConfig,)


class ShardedLlama(ShardedModel):
    """A `ShardedModel` of a Llama-style model (Llama, Qwen2, Mistral)."""

    cfg: LlamaConfig
    config_types = (LlamaConfig,)


def _check_config(cls: type[ShardedModel], cfg: ModelConfig) -> None:
    if not isinstance(cfg, cls.config_types):
        kinds = ", ".join(t.__name__ for t in cls.config_types)
        raise UnsupportedModelError(
            f"{cls.__name__} runs {kinds}; {cfg.name} is a {type(cfg).__name__} (use {sharded_class(cfg).__name__})"
        )


def sharded_class(cfg: ModelConfig) -> type[ShardedModel]:
    """The sharded-model class of `cfg`'s family (`ShardedModel` itself for a family without its own)."""
    classes: dict[type, type[ShardedModel]] = {OPTConfig: ShardedOPT, LlamaConfig: ShardedLlama}
    return classes.get(type(cfg), ShardedModel)
