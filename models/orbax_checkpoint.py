"""jaxserve checkpoints (Orbax): a placed model's NNX state out, and back in straight into any tp x pp layout.

A checkpoint directory holds `config.json`, `jaxserve_checkpoint.json` (format, name, dtype) and, under
`params/`, the whole model's module state as `nnx.to_pure_dict` writes it, unfused (format 2): the
top-level modules (`embed_tokens/embedding`, `norm/scale`, ...) and `layers/<global index>/...`, one
sub-tree per decoder layer. Each stage writes its own layers from its own devices (nothing is gathered), and
a restore reads each layer straight onto the devices of the stage that will hold it, so a checkpoint written
at one tp x pp restores at any other. Format 1 (stacked layer leaves, before the models were NNX modules) is
still read.

Orbax is imported only when a checkpoint is written or read (its import costs a server ~0.25 s of start-up).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models import params as module_params
from models.config import CheckpointError, ModelConfig, config_from_hf
from models.decoder import Params
from models.params import param_shapes
from models.placing import Placement, _get, _leaf_paths, _set

JAXSERVE_MARKER = "jaxserve_checkpoint.json"
FORMAT = 2


class PlacedModel(Protocol):
    """What saving needs of a placed model (`models.sharding.ShardedModel` is one)."""

    @property
    def cfg(self) -> ModelConfig: ...

    @property
    def layout(self) -> Placement: ...

    @property
    def run_params(self) -> list[dict[Any, Any]]: ...  # each stage's module state (a pure dict)

    @property
    def dtype(self) -> jnp.dtype: ...


def _global_mesh(layout: Placement) -> Mesh:
    devs = np.array([[d for d in st.mesh.devices.flat] for st in layout.stages])  # [pp, tp]
    return Mesh(devs, ("pp", "tp"))


def _global_spec(stage_sharding: NamedSharding, layer_leaf: bool) -> P:
    spec = tuple(stage_sharding.spec)
    if not layer_leaf:
        return P()
    return P("pp", *spec[1:])


def save_checkpoint(path: str | Path, model: PlacedModel) -> Path:
    """Write `model`'s NNX state (Orbax, under `path/params`) and `config.json`; returns `path`.

    A quantized model is refused (`models.quantize.QuantizationError`). Each stage's state goes in unfused, its layers under their global indices; a top-level module held by
    several stages (a tied head on the last stage beside the first's embedding) is written once.
    """
    import orbax.checkpoint as ocp

    from models.quantize import QuantizationError, is_quantized

    if any(is_quantized(state) for state in model.run_params):
        raise QuantizationError(
            "a jaxserve checkpoint holds float weights; this model serves quantized ones (save the float model, "
            "and quantize again at load: the same --quantization gives the same weights)"
        )
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    tree: dict[str, Any] = {}
    for st, state in zip(model.layout.stages, model.run_params, strict=True):
        for key, value in module_params.unfused_state(model.cfg, state).items():
            if key == "layers":
                layers = tree.setdefault("layers", {})
                layers.update({str(st.layers[0] + int(i)): lp for i, lp in value.items()})
            else:
                tree.setdefault(str(key), value)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path / "params", tree, force=True)
    ckptr.wait_until_finished()
    (path / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))
    meta = {"format": FORMAT, "name": model.cfg.name, "dtype": str(model.dtype)}
    (path / JAXSERVE_MARKER).write_text(json.dumps(meta))
    return path


def checkpoint_config(path: str | Path, dtype: Any = None) -> ModelConfig:
    """The config of a `save_checkpoint` directory, in `dtype` (default: the dtype it was saved in)."""
    path = Path(path).absolute()
    meta = json.loads((path / JAXSERVE_MARKER).read_text())
    cfg = config_from_hf(path / "config.json", name=meta.get("name"))
    return cfg.with_dtype(str(jnp.dtype(dtype or meta.get("dtype") or "float32")))


def restore_stage_params(path: str | Path, cfg: ModelConfig, layout: Placement) -> list[Params]:
    """Restore a `save_checkpoint` directory straight into `layout` (any tp x pp shape), in `cfg.dtype`: each
    stage's params (its layers one dict each, its top-level modules), what `ShardedModel` builds a stage from."""
    path = Path(path).absolute()
    fmt = json.loads((path / JAXSERVE_MARKER).read_text()).get("format", 1)
    if fmt == 1:
        return _restore_stacked(path, cfg, layout)
    if fmt != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {fmt}; this jaxserve reads formats 1 and {FORMAT}")
    return _restore_state(path, cfg, layout)


def _restore_state(path: Path, cfg: ModelConfig, layout: Placement) -> list[Params]:
    """Format 2: layer i is read onto the devices of the stage holding it, in that stage's sharding; a top-level
    module (replicated on every stage that holds it) is read once over all devices and each stage keeps its
    own devices' copies."""
    import orbax.checkpoint as ocp

    dt = jnp.dtype(cfg.dtype)
    gmesh = _global_mesh(layout)
    _, whole = module_params.abstract(cfg)
    target: dict[str, Any] = {}
    for key, var in nnx.to_flat_state(whole):
        if key[0] == "layers":
            i = int(str(key[1]))
            st = next(s for s in layout.stages if s.layers[0] <= i < s.layers[1])
            stacked = _get(st.param_shardings, module_params.checkpoint_path(key)[0])
            sharding = NamedSharding(st.mesh, P(*tuple(stacked.spec)[1:]))
        else:
            sharding = NamedSharding(gmesh, P())
        _set(target, tuple(str(k) for k in key), jax.ShapeDtypeStruct(tuple(var.shape), dt, sharding=sharding))
    restored = ocp.StandardCheckpointer().restore(path / "params", target)
    stage_params = []
    for st in layout.stages:
        start, end = st.layers
        devs = set(st.mesh.devices.flat)
        out: Params = {"layers": [restored["layers"][str(i)] for i in range(start, end)]}
        for name, shardings in st.param_shardings.items():
            if name == "layers":
                continue
            if any(
                tuple(sh.spec)
                for _, sh in _leaf_paths(shardings if isinstance(shardings, Mapping) else {"": shardings})
            ):
                raise CheckpointError(f"{path}: {name} is split over tp; only replicated top-level modules restore")
            replicated = NamedSharding(st.mesh, P())
            out[name] = jax.tree.map(
                lambda g, sh=replicated, devs=devs: jax.make_array_from_single_device_arrays(
                    g.shape, sh, [s.data for s in g.addressable_shards if s.device in devs]
                ),
                restored[name],
            )
        stage_params.append(out)
    return stage_params


def _restore_stacked(path: Path, cfg: ModelConfig, layout: Placement) -> list[Params]:
    """Format 1 (jaxserve before the NNX models): stacked checkpoint-layout leaves, each over a (pp, tp) mesh."""
    import orbax.checkpoint as ocp

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
