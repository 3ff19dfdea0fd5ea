"""Hugging Face directories and GGUF files in, Hugging Face directories out, as our checkpoint layout.

Hugging Face names (OPT: prefix `model.decoder.` or bare `decoder.`)::

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

GGUF files (llama.cpp's format; `models/gguf.py`) enter through the same reader: their tensors are presented
under the Llama names above, dequantized lazily.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from models import gguf
from models.config import LlamaConfig, ModelConfig, OPTConfig, config_from_hf
from models.decoder import HFNaming, Params
from models.families import model_class
from models.hf_files import open_hf_tensors
from models.params import param_shapes
from models.placing import HFReader, _leaf_paths, _set, hf_names
from models.stop_ids import with_checkpoint_stop_ids


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


def hf_tensors(params: Params, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """A whole model's params (one stage holding every layer, stacked) under the family's Hugging Face names.

    The inverse of `HFReader`: each stacked layer leaf becomes one tensor per layer, transposed where the
    family's naming says the Hugging Face tensor is stored the other way round.
    """
    naming: HFNaming = model_class(cfg).HF_NAMING
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
