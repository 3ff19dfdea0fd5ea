"""Checkpoints: Hugging Face OPT and Llama-style directories in, jaxserve Orbax checkpoints in and out, tokenizers.

Every tensor goes straight to its target sharding: a stage's stacked layer leaf is built with
`jax.make_array_from_callback`, whose callback reads only the slice a device holds (safetensors
files are memory-mapped, so a tp=4 shard reads a quarter of each kernel). The full model is never
assembled on one device when a sharded layout is asked for.

Hugging Face names (prefix `model.decoder.` or bare `decoder.`)::

    embed_tokens.weight [V, E]      embed_positions.weight [P+2, h]
    project_in.weight   [h, E]      project_out.weight     [E, h]     (Linear: [out, in])
    final_layer_norm.{weight,bias}
    layers.N.self_attn.{q,k,v,out}_proj.{weight,bias}
    layers.N.{self_attn_layer_norm,final_layer_norm}.{weight,bias}
    layers.N.{fc1,fc2}.{weight,bias}

Linear weights are transposed to our `[in, out]` kernels; `lm_head.weight` (tied) is ignored.

Llama / Qwen2 / Mistral names (prefix `model.`; the untied head `lm_head.weight` [V, h] has none)::

    embed_tokens.weight [V, h]      norm.weight [h]
    layers.N.input_layernorm.weight, layers.N.post_attention_layernorm.weight
    layers.N.self_attn.{q,k,v,o}_proj.{weight,bias}   (biases: Qwen2's q/k/v; o with attention_bias)
    layers.N.mlp.{gate,up,down}_proj.weight

Every expected tensor is checked for presence and shape, and every safetensors file for a complete
header and data, before any tensor is read: a bad checkpoint is one `CheckpointError` naming what.

GGUF files (llama.cpp's format; `models/gguf.py`) enter through the same reader: their tensors are
presented under the Llama names above, dequantized lazily.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import gguf
from models.config import CheckpointError, LlamaConfig, ModelConfig, OPTConfig, config_from_hf, get_model_config
from models.decoder import HFNaming
from models.families import family
from models.opt import Params
from models.stop_ids import with_checkpoint_stop_ids

if TYPE_CHECKING:
    import tokenizers

log = logging.getLogger(__name__)

Index = tuple[slice, ...]
JAXSERVE_MARKER = "jaxserve_checkpoint.json"


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


class PlacedModel(Protocol):
    """What saving needs of a placed model (`models.sharding.ShardedOPT` is one)."""

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def layout(self) -> Placement: ...

    @property
    def stage_params(self) -> list[Params]: ...

    @property
    def dtype(self) -> jnp.dtype: ...


class TensorLike(Protocol):
    """A tensor read by slices: a numpy array (memory-mapped or not) or a lazily dequantized GGUF tensor."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, index: Any) -> Any: ...


# ------------------------------------------------------------------------------------------
# Tensor sources: name -> lazily readable array
# ------------------------------------------------------------------------------------------

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _open_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of a .safetensors file (header: u64 length + JSON; then raw data).

    A file cut short (in the header or in any tensor's data) is a `CheckpointError` here, before
    a memory map would fault on the missing bytes at first read.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header of {header_len} bytes, file {size}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from e
    base = 8 + header_len
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        shape = tuple(meta["shape"])
        start, end = meta["data_offsets"]
        if end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{path}: tensor {name} spans {end - start} bytes, its shape {shape} needs more")
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name} ends at byte {base + end}, file has {size}"
            )
        if int(np.prod(shape)) == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)
    return out


def _open_torch(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a test dependency
        raise CheckpointError(f"{path}: reading pytorch_model.bin needs torch, which is not installed") from e
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        t = t.detach()
        if t.dtype == torch.bfloat16:
            out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[name] = t.numpy()
    return out


def open_hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of a HF checkpoint dir as lazily-read arrays (safetensors, sharded or not; torch .bin)."""
    files: list[Path]
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({directory / f for f in weight_map.values()})
            break
    else:
        files = [p for p in (directory / "model.safetensors", directory / "pytorch_model.bin") if p.exists()][:1]
    if not files:
        raise CheckpointError(f"{directory}: no model.safetensors, sharded index or pytorch_model.bin found")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{directory}: index names {f.name}, which does not exist")
        tensors.update(_open_safetensors(f) if f.suffix == ".safetensors" else _open_torch(f))
    return tensors


# ------------------------------------------------------------------------------------------
# Readers: our param layout (full model, global layer index) -> slices of numpy data
# ------------------------------------------------------------------------------------------


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


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The full param tree's leaf shapes for either family."""
    return family(cfg).param_shapes(cfg)  # type: ignore[no-any-return]


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
        self.naming: HFNaming = family(cfg).HF_NAMING
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


# ------------------------------------------------------------------------------------------
# Hugging Face directories
# ------------------------------------------------------------------------------------------


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(
        (path / n).exists()
        for n in (
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        )
    )


def load_hf_config(directory: str | Path) -> OPTConfig:
    """The config of a HF OPT directory (what the runtime serves today; a Llama-style one is an error)."""
    directory = Path(directory)
    return OPTConfig.from_hf_config(directory / "config.json", name=directory.name)


def load_hf_model_config(directory: str | Path) -> ModelConfig:
    """The config of a HF directory: OPT or a Llama-style family (`UnsupportedModelError` for anything else)."""
    directory = Path(directory)
    # config.json's EOS and every other stop id the directory declares (generation config, tokenizer)
    return with_checkpoint_stop_ids(config_from_hf(directory / "config.json", name=directory.name), directory)


def load_hf_params(directory: str | Path, cfg: ModelConfig | None = None, dtype: Any = jnp.float32) -> Params:
    """A HF checkpoint (OPT or Llama-style) as one host-side (numpy) param tree in our layout — for tests and tools."""
    directory = Path(directory)
    cfg = cfg or load_hf_model_config(directory)
    return params_from_hf_tensors(open_hf_tensors(directory), cfg, dtype, source=str(directory))


def params_from_hf_tensors(
    tensors: Mapping[str, np.ndarray], cfg: ModelConfig, dtype: Any = jnp.float32, source: str = "tensors"
) -> Params:
    """Our host-side (numpy) param tree from HF-named tensors (e.g. a torch `state_dict()` as numpy)."""
    reader = HFReader(tensors, cfg, source)
    out: Params = {}
    for path, shape in _leaf_paths(param_shapes(cfg)):
        _set(out, path, reader.read(path, (slice(None),) * len(shape)).astype(jnp.dtype(dtype)))
    return out


# ------------------------------------------------------------------------------------------
# GGUF files
# ------------------------------------------------------------------------------------------


def _gguf_name(path: Path) -> str:
    return path.parent.name if path.name == "model.gguf" else path.stem


def load_gguf_config(path: str | Path) -> LlamaConfig:
    """The config of a GGUF file (`UnsupportedModelError` for an architecture or option we do not implement)."""
    path = Path(path)
    return gguf.gguf_config(gguf.open_gguf(path), name=_gguf_name(path))


def gguf_reader(path: str | Path, cfg: LlamaConfig) -> HFReader:
    """A reader of a GGUF file's params, every tensor's presence, type and shape checked against `cfg` first."""
    f = gguf.open_gguf(path)
    return HFReader(gguf.hf_tensors(f, cfg), cfg, str(path))


def load_gguf_params(path: str | Path, cfg: LlamaConfig | None = None, dtype: Any = jnp.float32) -> Params:
    """A GGUF file as one host-side (numpy) param tree in our layout, dequantized — for tests and tools."""
    cfg = cfg or load_gguf_config(path)
    reader = gguf_reader(path, cfg)
    out: Params = {}
    for leaf, shape in _leaf_paths(param_shapes(cfg)):
        _set(out, leaf, reader.read(leaf, (slice(None),) * len(shape)).astype(jnp.dtype(dtype)))
    return out


# ------------------------------------------------------------------------------------------
# jaxserve (Orbax) checkpoints
# ------------------------------------------------------------------------------------------


def _global_mesh(layout: Placement) -> Mesh:
    devs = np.array([[d for d in st.mesh.devices.flat] for st in layout.stages])  # [pp, tp]
    return Mesh(devs, ("pp", "tp"))


def _global_spec(stage_sharding: NamedSharding, layer_leaf: bool) -> P:
    spec = tuple(stage_sharding.spec)
    if not layer_leaf:
        return P()
    return P("pp", *spec[1:])


def save_checkpoint(path: str | Path, model: PlacedModel) -> Path:
    """Write `model`'s params (Orbax, under `path/params`) and `config.json`; returns `path`.

    Stacked layer leaves are saved as whole-model arrays: the stages' shards are viewed as one
    array over a (pp, tp) mesh without copying, so any later layout can restore them.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    layout, cfg = model.layout, model.cfg
    stage_params = model.stage_params  # stacked layer leaves
    gmesh = _global_mesh(layout)
    tree: Params = {}
    full_shapes = param_shapes(cfg)
    last = layout.stages[-1]
    for path_, sharding in _leaf_paths(last.param_shardings) + _leaf_paths(layout.stages[0].param_shardings):
        if path_[0] == "layers":
            arrays = [_get(sp, path_) for sp in stage_params]
            gshape = _get(full_shapes, path_)
            gsharding = NamedSharding(gmesh, _global_spec(sharding, True))
            shards = [s.data for a in arrays for s in a.addressable_shards]
            _set(tree, path_, jax.make_array_from_single_device_arrays(tuple(gshape), gsharding, shards))
        else:
            stage = 0 if _has(stage_params[0], path_) else len(layout.stages) - 1
            _set(tree, path_, _get(stage_params[stage], path_))
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "params", tree, force=True)
    ckptr.wait_until_finished()
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    (path / JAXSERVE_MARKER).write_text(json.dumps({"format": 1, "name": cfg.name, "dtype": str(model.dtype)}))
    return path


def hf_tensors(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A whole model's params (one stage holding every layer, stacked) under the family's Hugging Face names.

    The inverse of `HFReader`: each stacked layer leaf becomes one tensor per layer, transposed where the
    family's naming says the Hugging Face tensor is stored the other way round.
    """
    naming: HFNaming = family(cfg).HF_NAMING
    out: dict[str, np.ndarray] = {}
    for path, leaf in _leaf_paths(params):
        a = np.asarray(leaf)
        slices = list(a) if path[0] == "layers" else [a]  # a stacked layer leaf: one tensor per layer
        for x, (name, transpose) in zip(
            slices, hf_names(naming, naming.prefixes[0], cfg.num_layers, path), strict=True
        ):
            out[name] = np.ascontiguousarray(x.T if transpose else x)
    return out


def save_hf_checkpoint(path: str | Path, params: Params, cfg: ModelConfig) -> Path:
    """Write `params` (one full-model tree, in the dtype to store) as a Hugging Face directory: `config.json` and
    `model.safetensors`, which `transformers`' `from_pretrained` and `load_stage_params` both read. Returns `path`.

    Loading it needs no Orbax (whose import costs a server ~0.25 s of start-up): the shipped default model
    is stored this way.
    """
    from safetensors.numpy import save_file

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(params, cfg)
    dtypes = {str(t.dtype) for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"params hold several dtypes ({sorted(dtypes)}); cast them to the one to store first")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict() | {"torch_dtype": dtypes.pop()}
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return path


def _has(tree: Mapping[str, Any], path: tuple[str, ...]) -> bool:
    try:
        _get(tree, path)
    except KeyError:
        return False
    return True


def checkpoint_config(path: str | Path, dtype: Any = None) -> ModelConfig:
    """The config of a `save_checkpoint` directory, in `dtype` (default: the dtype it was saved in)."""
    path = Path(path).absolute()
    meta = json.loads((path / JAXSERVE_MARKER).read_text())
    cfg = config_from_hf(path / "config.json", name=meta.get("name"))
    return cfg.with_dtype(str(jnp.dtype(dtype or meta.get("dtype") or "float32")))


def restore_stage_params(path: str | Path, cfg: ModelConfig, layout: Placement) -> list[Params]:
    """Restore a `save_checkpoint` directory straight into `layout` (any tp x pp shape), in `cfg.dtype`."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    dt = jnp.dtype(cfg.dtype)
    gmesh = _global_mesh(layout)
    full_shapes = param_shapes(cfg)
    target: Params = {}
    for path_, shape in _leaf_paths(full_shapes):
        if path_[0] == "layers":
            spec = _global_spec(_get(layout.stages[0].param_shardings, path_), True)
        else:
            spec = P()  # restored once across all devices; each stage keeps its own devices' copies
        _set(target, path_, jax.ShapeDtypeStruct(tuple(shape), dt, sharding=NamedSharding(gmesh, spec)))
    ckptr = ocp.StandardCheckpointer()
    restored = ckptr.restore(path / "params", target)
    stage_params = []
    for st in layout.stages:
        start, end = st.layers
        devs = set(st.mesh.devices.flat)
        out: Params = {}
        for path_, sharding in _leaf_paths(st.param_shardings):
            g = _get(restored, path_)
            shape = (end - start, *g.shape[1:]) if path_[0] == "layers" else g.shape
            shards = [s.data for s in g.addressable_shards if s.device in devs]
            _set(out, path_, jax.make_array_from_single_device_arrays(tuple(shape), sharding, shards))
        stage_params.append(out)
    return stage_params


# ------------------------------------------------------------------------------------------
# One entry point
# ------------------------------------------------------------------------------------------


def source_config(source: str | Path, dtype: Any = "float32") -> ModelConfig:
    """The config of a model source: a jaxserve checkpoint dir, a HF dir, or a preset name."""
    path = Path(source)
    if path.is_dir() and (path / JAXSERVE_MARKER).exists():
        return checkpoint_config(path, dtype)
    if path.is_dir() and is_hf_dir(path):
        return load_hf_model_config(path).with_dtype(str(jnp.dtype(dtype)))
    gguf_path = gguf.find_gguf(path)
    if gguf_path is not None:
        return load_gguf_config(gguf_path).with_dtype(str(jnp.dtype(dtype)))
    if path.exists():
        raise CheckpointError(
            f"{path}: neither a Hugging Face OPT directory nor a jaxserve checkpoint (nor a Llama-style HF directory, "
            "a .gguf file, or a directory holding one)"
        )
    return get_model_config(str(source)).with_dtype(str(jnp.dtype(dtype)))


def load_stage_params(
    source: str | Path, cfg: ModelConfig, layout: Placement, dtype: Any = "float32", seed: int = 0
) -> list[Params]:
    """Every stage's params of `source` (see `source_config`) placed on `layout`, in `cfg.dtype`.

    A preset name gives random weights (seed `seed`), with a warning. A GGUF file is dequantized as
    it is placed: each device dequantizes only the rows of each tensor it holds.
    """
    path = Path(source)
    if path.is_dir() and (path / JAXSERVE_MARKER).exists():
        return restore_stage_params(path, cfg, layout)
    if path.is_dir() and is_hf_dir(path):
        reader = HFReader(open_hf_tensors(path), cfg, str(path))
        return place_params(reader, cfg, layout, cfg.dtype)
    gguf_path = gguf.find_gguf(path)
    if gguf_path is not None:
        if not isinstance(cfg, LlamaConfig):
            raise CheckpointError(f"{gguf_path}: a GGUF file holds a Llama-style model, the config is {cfg.name}'s")
        return place_params(gguf_reader(gguf_path, cfg), cfg, layout, cfg.dtype)
    log.warning("model %r is a preset name, not a checkpoint: using RANDOM weights (seed %d)", str(source), seed)
    with jax.default_device(jax.devices("cpu")[0]):
        key = jax.random.key(seed)
        params = family(cfg).init_params(cfg, key)
    return place_params(ParamTreeReader(params), cfg, layout, cfg.dtype)


# ------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------


def load_tokenizer(directory: str | Path) -> tokenizers.Tokenizer | None:
    """`tokenizer.json`, GPT-2 style `vocab.json` + `merges.txt` (with OPT's `</s>` BOS), or the tokenizer a
    GGUF file (or a directory holding one) describes; None if none of these."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors

    directory = Path(directory)
    gguf_path = gguf.find_gguf(directory) if directory.exists() else None
    if gguf_path is not None:
        return gguf.gguf_tokenizer(gguf.open_gguf(gguf_path))
    if (directory / "tokenizer.json").exists():
        return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if not (vocab.exists() and merges.exists()):
        return None
    tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t in ("<s>", "<pad>", "</s>", "<unk>") if tok.token_to_id(t) is not None]
    tok.add_special_tokens(specials)  # already in the vocab: keeps their ids, marks them special
    bos = tok.token_to_id("</s>")
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", bos)])
    return tok


@dataclasses.dataclass(frozen=True)
class CheckpointChatTemplate:
    """A checkpoint's own chat template (Jinja source, as `transformers`' `apply_chat_template` renders it).

    `special_tokens` are the texts of the vocabulary's special tokens: chat content may not spell them
    (`jaxserve.serving.chat_template` refuses such content).
    """

    template: str
    bos_token: str | None = None
    eos_token: str | None = None
    special_tokens: tuple[str, ...] = ()


def _token_content(value: Any) -> str | None:
    """A `tokenizer_config.json` token entry: a string, or an AddedToken dict with a `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_chat_template(source: str | Path) -> CheckpointChatTemplate | None:
    """The chat template a checkpoint carries, or None.

    GGUF: `tokenizer.chat_template` (with its BOS/EOS and control tokens). Hugging Face directory:
    `chat_template` of `tokenizer_config.json` (a string, or the entry named "default" of a list), or
    `chat_template.jinja`; bos/eos tokens from `tokenizer_config.json`, special tokens from it and
    `tokenizer.json`'s added tokens.
    """
    path = Path(source)
    if not path.exists():
        return None
    gguf_path = gguf.find_gguf(path)
    if gguf_path is not None:
        f = gguf.open_gguf(gguf_path)
        template = f.get("tokenizer.chat_template")
        if not template:
            return None
        return CheckpointChatTemplate(
            str(template),
            gguf.token_text(f, "bos_token_id"),
            gguf.token_text(f, "eos_token_id"),
            tuple(gguf.special_token_texts(f)),
        )
    if not path.is_dir():
        return None
    config_path = path / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
    raw = config.get("chat_template")
    if isinstance(raw, list):
        raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
    if not raw and (path / "chat_template.jinja").exists():
        raw = (path / "chat_template.jinja").read_text()
    if not isinstance(raw, str) or not raw:
        return None
    specials: list[str] = []
    for entry in (config.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and entry.get("special") and entry.get("content"):
            specials.append(str(entry["content"]))
    if (path / "tokenizer.json").exists():
        added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens") or []
        specials.extend(str(t["content"]) for t in added if t.get("special") and t.get("content"))
    return CheckpointChatTemplate(
        raw,
        _token_content(config.get("bos_token")),
        _token_content(config.get("eos_token")),
        tuple(dict.fromkeys(specials)),
    )
