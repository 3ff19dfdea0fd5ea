"""Placing a model's params on its stages: readers of the checkpoint layout and `place_params`.

Every tensor goes straight to its target sharding: a stage's stacked layer leaf is built with
`jax.make_array_from_callback`, whose callback reads only the slice a device holds (safetensors files are
memory-mapped, so a tp=4 shard reads a quarter of each kernel; a GGUF tensor dequantizes only those rows).
The full model is never assembled on one device when a sharded layout is asked for. The shardings come from
the parameters' logical axes (`models.sharding.param_specs`), the shapes from the family's abstract model
(`models.params.param_shapes`).

`HFReader` reads our layout out of Hugging Face-named tensors through the family's `HF_NAMING`, and checks
every expected tensor's presence and shape before any is read: a bad checkpoint is one `CheckpointError`
naming what.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from models.config import CheckpointError, ModelConfig
from models.decoder import HFNaming, Params
from models.families import model_class
from models.params import param_shapes

Index = tuple[slice, ...]


class StagePlacement(Protocol):
    """What loading needs of one pipeline stage's layout (`models.sharding.StageLayout` is one)."""

    @property
    def layers(self) -> tuple[int, int]: ...

    @property
    def mesh(self) -> Mesh: ...

    @property
    def param_shardings(self) -> dict[str, Any]: ...


class Placement(Protocol):
    """Where every stage's params go (`models.sharding.ParallelLayout` is one).

    A structural type, so this module never imports `models.sharding` (which imports it to load).
    """

    @property
    def stages(self) -> Sequence[StagePlacement]: ...


class TensorLike(Protocol):
    """A tensor read by slices: a numpy array (memory-mapped or not) or a lazily dequantized GGUF tensor."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: Any) -> Any: ...


def _leaf_paths(tree: Mapping[str, Any], prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out: list[tuple[tuple[str, ...], Any]] = []
    for k, v in tree.items():
        if isinstance(v, Mapping):
            out.extend(_leaf_paths(v, (*prefix, k)))
        else:
            out.append(((*prefix, k), v))
    return out


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


class ParamTreeReader:
    """Reads slices of an in-memory param tree in our layout (numpy or jax arrays)."""

    def __init__(self, params: Params):
        self.params = params

    def read(self, path: tuple[str, ...], index: Index) -> np.ndarray:
        return np.asarray(_get(self.params, path)[index])


def hf_names(naming: HFNaming, prefix: str, num_layers: int, path: tuple[str, ...]) -> list[tuple[str, bool]]:
    """The Hugging Face tensor names of our leaf `path` (one per layer for a stacked layer leaf), each with
    whether it is stored transposed."""
    if path[0] == "layers":
        suffix, transpose = naming.layer_names[(path[1], path[2])]
        return [(f"{prefix}layers.{i}.{suffix}", transpose) for i in range(num_layers)]
    name, transpose = naming.top_names[path]
    return [(name if path in naming.unprefixed else prefix + name, transpose)]


class HFReader:
    """Reads slices of our params out of Hugging Face tensors (OPT or Llama-style); validates names and shapes up front."""

    def __init__(self, tensors: Mapping[str, TensorLike], cfg: ModelConfig, source: str = "checkpoint"):
        self.tensors = tensors
        self.cfg = cfg
        self.naming: HFNaming = model_class(cfg).HF_NAMING
        prefixes = self.naming.prefixes
        self.prefix = next((p for p in prefixes if f"{p}embed_tokens.weight" in tensors), prefixes[0])
        problems = []
        for path, shape in _leaf_paths(param_shapes(cfg)):
            for name, transpose in self._hf_names(path):
                expected = shape[1:] if path[0] == "layers" else shape
                if transpose:
                    expected = expected[::-1]
                got = tensors.get(name)
                if got is None:
                    problems.append(f"missing tensor {name} (expected shape {tuple(expected)})")
                elif tuple(got.shape) != tuple(expected):
                    problems.append(f"tensor {name} has shape {tuple(got.shape)}, expected {tuple(expected)}")
        if problems:
            raise CheckpointError(f"{source}: " + "; ".join(problems))

    def _hf_names(self, path: tuple[str, ...]) -> list[tuple[str, bool]]:
        return hf_names(self.naming, self.prefix, self.cfg.num_layers, path)

    def read(self, path: tuple[str, ...], index: Index) -> np.ndarray:
        if path[0] == "layers":
            suffix, transpose = self.naming.layer_names[(path[1], path[2])]
            layers = range(*index[0].indices(self.cfg.num_layers))
            rest = index[1:]
            parts = []
            for i in layers:
                t = self.tensors[f"{self.prefix}layers.{i}.{suffix}"]
                parts.append(np.asarray(t[rest[::-1]]).T if transpose else np.asarray(t[rest]))
            return np.stack(parts)
        [(name, transpose)] = self._hf_names(path)
        t = self.tensors[name]
        return np.asarray(t[index[::-1]]).T if transpose else np.asarray(t[index])


def _pad_index(index: Index, ndim: int) -> Index:
    return tuple(index) + (slice(None),) * (ndim - len(index))


def _leaf_callback(
    reader: ParamTreeReader | HFReader,
    path: tuple[str, ...],
    layer_range: tuple[int, int] | None,
    ndim: int,
    dtype: Any,
) -> Callable[[Index | None], np.ndarray]:
    """Callback for `make_array_from_callback`: the device's slice of a leaf, read from `reader`.

    For a stage's layer leaf, `layer_range` is the stage's `[start, end)` global layers: the
    stage-local layer slice is shifted to the global one the reader understands.
    """

    def cb(index: Index | None) -> np.ndarray:
        idx = _pad_index(index or (), ndim)
        if layer_range is not None:
            start, end = layer_range
            lo, hi, _ = idx[0].indices(end - start)
            idx = (slice(start + lo, start + hi), *idx[1:])
        return reader.read(path, idx).astype(dtype, copy=False)  # no second copy of a leaf already in dtype

    return cb


def place_params(reader: ParamTreeReader | HFReader, cfg: ModelConfig, layout: Placement, dtype: Any) -> list[Params]:
    """Build every stage's param tree on its mesh; each device reads only the slice it holds."""
    dtype = jnp.dtype(dtype)
    full_shapes = param_shapes(cfg)
    stages = []
    for st in layout.stages:
        start, end = st.layers
        out: Params = {}
        for path, sharding in _leaf_paths(st.param_shardings):
            full_shape = tuple(_get(full_shapes, path))
            if path[0] == "layers":
                shape = (end - start, *full_shape[1:])
                cb = _leaf_callback(reader, path, (start, end), len(shape), dtype)
            else:
                shape = full_shape
                cb = _leaf_callback(reader, path, None, len(shape), dtype)
            _set(out, path, jax.make_array_from_callback(shape, sharding, cb))
        stages.append(out)
    return stages
