"""A model's `flax.nnx` form and its checkpoint layout, and the conversions between them.

Two layouts of the same weights:

* the **module state** (`nnx.split(model)`): what the jitted steps take. One sub-tree per decoder layer
  (`layers/0/q_proj/kernel`, ...), so the unrolled layer loop reads each weight in place (a per-layer slice of
  a stacked array is a copy on XLA:CPU), and on a one-device stage the projections of one input fused
  (`qkv_proj`, `gate_up_proj`: `models.layers.add_projections`);
* the **checkpoint layout** (a nested dict, `Params`): what checkpoints hold and the loaders place shard by
  shard (`models.checkpoint`): each decoder leaf stacked `[L, ...]` under `"layers"`, projections unfused, and
  a top-level module's `embedding` or `kernel` (an embedding table, a bias-free projection) stored as a bare
  array under the module's name (`embed_tokens`, `project_in`, `lm_head`).

Parameter paths are the same in both apart from the layer index and those one-weight modules, so this
module maps one to the other for every family without a table per family.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.decoder import Params
from models.families import model_class
from models.layers import WHOLE, Stage

# Fused projection -> its parts, in column order (every family uses these names; a family without a group
# simply has no such module).
FUSIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# The one weight of a top-level module that the checkpoint layout stores as a bare array under the module's name.
_BARE = ("embedding", "kernel")

Path = tuple[Any, ...]


def build(cfg: ModelConfig, stage: Stage = WHOLE, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None) -> Any:
    """The family's model, or the `stage` of it (`models.layers.Stage`), with random weights."""
    return model_class(cfg)(cfg, stage, dtype=dtype, rngs=rngs or nnx.Rngs(0))


def abstract(cfg: ModelConfig, stage: Stage = WHOLE, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef[Any], nnx.State]:
    """The graph and the abstract state (`jax.ShapeDtypeStruct` values, logical axes as metadata) of the model's
    `stage`: nothing is allocated. `dtype` is the weights' (an `nnx.Embed` computes in the dtype it was built with).

    Built from one abstract layer, cloned `num_layers` times: `nnx.eval_shape` traces every parameter's
    initializer and RNG draw (~30 ms a parameter on the loaded 2-core machine: 20 s for an 80-layer stage),
    while a clone of an abstract layer is graph bookkeeping only.
    """
    one = _abstract_one_layer(cfg, dataclasses.replace(stage, num_layers=1), jnp.dtype(dtype).name)
    n = cfg.num_layers if stage.num_layers is None else stage.num_layers
    model = nnx.clone(one)
    layer_graph, layer_state = nnx.split(one.layers[0])
    model.layers = nnx.List([nnx.merge(layer_graph, layer_state, copy=True) for _ in range(n)])
    return nnx.split(model)


@functools.lru_cache(maxsize=32)
def _abstract_one_layer(cfg: ModelConfig, stage: Stage, dtype: str) -> Any:
    """A stage of one layer, abstract (shared: callers clone it)."""
    return nnx.eval_shape(lambda: build(cfg, stage, dtype=dtype))


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The whole model's checkpoint-layout tree with a shape tuple at every leaf (layer leaves `[L, ...]`), read
    off the family's abstract model (one layer of it: the layers are alike)."""
    _, state = abstract(cfg, Stage(num_layers=1))
    out: dict[str, Any] = {}
    for path, var in _flat(state):
        key, layer = checkpoint_path(path)
        node = out
        for p in key[:-1]:
            node = node.setdefault(p, {})
        node[key[-1]] = (cfg.num_layers, *var.shape) if layer is not None else tuple(var.shape)
    return out


def init_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> Params:
    """Random weights in the checkpoint layout (presets, tests): normal(0, 0.02) matrices and biases, unit norm
    scales; a family whose class says `ZERO_BIASES` (OPT, as Hugging Face initialises it) gets zero biases."""
    dtype = jnp.dtype(dtype)
    zero_biases = bool(getattr(model_class(cfg), "ZERO_BIASES", False))
    leaves, treedef = jax.tree.flatten_with_path(param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    out = []
    for (path, shape), k in zip(leaves, keys, strict=True):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            out.append(jnp.ones(shape, dtype))
        elif zero_biases and "bias" in name:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def checkpoint_path(path: Path) -> tuple[tuple[str, ...], int | None]:
    """A module-state path -> (its checkpoint-layout path, its layer index or None): `layers/3/q_proj/kernel`
    -> (`layers/q_proj/kernel`, 3); `embed_tokens/embedding` -> (`embed_tokens`, None)."""
    if path[0] == "layers":
        return ("layers", *(str(p) for p in path[2:])), int(path[1])
    if _is_bare(path):
        return (str(path[0]),), None
    return tuple(str(p) for p in path), None


def _is_bare(path: Path) -> bool:
    """Whether a module-state path is a top-level module's one weight, stored bare in the checkpoint layout."""
    return path[0] != "layers" and len(path) == 2 and path[1] in _BARE


def _flat(state: nnx.State) -> list[tuple[Path, Any]]:
    return list(nnx.to_flat_state(state))


def _get(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def state_from_params(abstract_state: nnx.State, params: Params) -> dict[Any, Any]:
    """The pure-dict module state (`nnx.replace_by_pure_dict` takes it) of checkpoint-layout `params`.

    `params["layers"]` is stacked leaves `[L, ...]` or one dict per layer (maybe already fused, as
    `fuse_layer` writes it); a fused module of the state is the concatenation of its parts.
    Pure array work: run it inside `jax.jit` to place the result (`models.sharding`).
    """
    layers = params.get("layers")
    per_layer: list[Mapping[str, Any]] | None = None
    if isinstance(layers, Sequence):
        per_layer = list(layers)
    out: dict[Any, Any] = {}
    for path, _ in _flat(abstract_state):
        if path[0] == "layers":
            i, name, rest = int(path[1]), str(path[2]), tuple(str(p) for p in path[3:])
            value = _layer_leaf(layers, per_layer, i, name, rest)
        elif _is_bare(path):
            node = params[str(path[0])]  # the bare array, or the module's own dict (a restored module state)
            value = node[path[1]] if isinstance(node, Mapping) else node
        else:
            value = _get(params, [str(p) for p in path])
        node = out
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = value
    return out


def _layer_leaf(
    stacked: Any, per_layer: list[Mapping[str, Any]] | None, i: int, name: str, rest: tuple[str, ...]
) -> jax.Array:
    def leaf(module: str) -> jax.Array:
        if per_layer is not None:
            return _get(per_layer[i][module], rest)  # type: ignore[no-any-return]
        return _get(stacked[module], rest)[i]  # type: ignore[no-any-return]

    have = per_layer[i] if per_layer is not None else stacked
    if name in FUSIONS and name not in have:
        return jnp.concatenate([leaf(part) for part in FUSIONS[name]], axis=-1)
    return leaf(name)


def unfused_state(cfg: ModelConfig, state: nnx.State | Mapping[Any, Any]) -> dict[Any, Any]:
    """A module state (an `nnx.State`, or its pure dict) as a pure dict with each fused projection split back
    into its parts (widths from the unfused module): the layout of a stage on several devices, whatever stage
    it came from."""
    pure = nnx.to_pure_dict(state) if isinstance(state, nnx.State) else _copy_dicts(state)
    _, unfused = abstract(cfg, Stage(num_layers=1))
    widths = {str(p[2]): v.shape[-1] for p, v in _flat(unfused) if p[0] == "layers" and p[-1] == "kernel"}
    for layer in pure.get("layers", {}).values():
        for fused, parts in FUSIONS.items():
            if fused not in layer:
                continue
            for key, whole in layer.pop(fused).items():
                for part, piece in zip(
                    parts, jnp.split(whole, _offsets([widths[p] for p in parts]), axis=-1), strict=True
                ):
                    layer.setdefault(part, {})[key] = piece
    return pure


def _copy_dicts(tree: Mapping[Any, Any]) -> dict[Any, Any]:
    """`tree`'s dicts copied (its arrays shared), so the copy's structure can be changed."""
    return {k: _copy_dicts(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def params_from_state(cfg: ModelConfig, state: nnx.State | Mapping[Any, Any]) -> Params:
    """The checkpoint layout of a module state: layer leaves stacked `[L, ...]`, fused projections split back
    into their parts, one-weight top-level modules as bare arrays."""
    pure = unfused_state(cfg, state)
    out: Params = {}
    for key, value in pure.items():
        if key == "layers":
            layers = [value[i] for i in sorted(value)]
            out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        elif isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in _BARE:
            out[str(key)] = next(iter(value.values()))
        else:
            out[str(key)] = value
    return out


def unstack_layers(layers: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Stacked layer leaves `[L, ...]` -> one dict of `[...]` leaves per layer (checkpoint layout)."""
    n = int(jax.tree.leaves(dict(layers))[0].shape[0])
    return [jax.tree.map(lambda x, i=i: x[i], dict(layers)) for i in range(n)]


def fuse_layer(layer: Mapping[str, Any]) -> dict[str, Any]:
    """One layer's checkpoint-layout params with each group of `FUSIONS` as one `[in, sum(out)]` kernel (and
    bias): the layout of a one-device stage's module state (`models.layers.add_projections`)."""
    out = dict(layer)
    for fused, parts in FUSIONS.items():
        if all(p in out for p in parts):
            pieces = [out.pop(p) for p in parts]
            out[fused] = {key: jnp.concatenate([piece[key] for piece in pieces], axis=-1) for key in pieces[0]}
    return out


def _offsets(widths: Sequence[int]) -> list[int]:
    out, total = [], 0
    for w in widths[:-1]:
        total += w
        out.append(total)
    return out


def logical_axes(abstract_state: nnx.State) -> dict[Path, tuple[str | None, ...]]:
    """Each parameter's logical axis names (`models.layers.AXES` metadata), by module-state path."""
    from models.layers import AXES

    return {path: tuple(var.get_metadata().get(AXES) or ()) for path, var in _flat(abstract_state)}


def model_from_params(cfg: ModelConfig, params: Params) -> Any:
    """The whole model over checkpoint-layout `params` (stacked, or one dict per layer, fused or not); inside
    a jitted function this is trace-time work around the same arrays."""
    layers = params["layers"]
    if isinstance(layers, Sequence):
        num_layers, fused = len(layers), any(name in layers[0] for name in FUSIONS) if layers else False
    else:
        num_layers, fused = int(jax.tree.leaves(dict(layers))[0].shape[0]), any(name in layers for name in FUSIONS)
    dtype = jax.tree.leaves(dict(params))[0].dtype
    graphdef, abstract_state = abstract(cfg, Stage(num_layers=num_layers, fused=fused), dtype)
    nnx.replace_by_pure_dict(abstract_state, state_from_params(abstract_state, params))
    return nnx.merge(graphdef, abstract_state)
