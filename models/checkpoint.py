"""Model sources in: one entry point (`source_config`, `load_stage_params`) over every kind of checkpoint.

A source is a jaxserve (Orbax) checkpoint directory, a Hugging Face directory (OPT or Llama-style), a `.gguf`
file (or a directory holding one), or a preset name (random weights). The roles live in their own modules, and
their names stay importable from here:

* `models.hf_files` — Hugging Face files as lazily read arrays (safetensors, `pytorch_model.bin`, indexes);
* `models.placing` — placing a stage's params straight into its sharding, slice by slice (`HFReader`,
  `place_params`);
* `models.hf_checkpoint` — Hugging Face directories and GGUF files in, Hugging Face directories out;
* `models.orbax_checkpoint` — jaxserve checkpoints: the NNX state out, and back into any layout;
* `models.tokenizer` — tokenizers and chat templates.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from models import gguf
from models.config import CheckpointError, LlamaConfig, ModelConfig, get_model_config
from models.decoder import Params
from models.hf_checkpoint import (
    gguf_reader,
    hf_tensors,
    load_gguf_config,
    load_gguf_params,
    load_hf_config,
    load_hf_model_config,
    load_hf_params,
    params_from_hf_tensors,
    save_hf_checkpoint,
)
from models.hf_files import is_hf_dir, open_hf_tensors
from models.orbax_checkpoint import (
    JAXSERVE_MARKER,
    PlacedModel,
    checkpoint_config,
    restore_stage_params,
    save_checkpoint,
)
from models.params import init_params
from models.placing import HFReader, ParamTreeReader, Placement, StagePlacement, TensorLike, hf_names, place_params
from models.tokenizer import CheckpointChatTemplate, load_chat_template, load_tokenizer

__all__ = [
    "JAXSERVE_MARKER",
    "CheckpointChatTemplate",
    "CheckpointError",
    "HFReader",
    "ParamTreeReader",
    "PlacedModel",
    "Placement",
    "StagePlacement",
    "TensorLike",
    "checkpoint_config",
    "gguf",
    "gguf_reader",
    "hf_names",
    "hf_tensors",
    "is_hf_dir",
    "load_chat_template",
    "load_gguf_config",
    "load_gguf_params",
    "load_hf_config",
    "load_hf_model_config",
    "load_hf_params",
    "load_stage_params",
    "load_tokenizer",
    "open_hf_tensors",
    "params_from_hf_tensors",
    "place_params",
    "restore_stage_params",
    "save_checkpoint",
    "save_hf_checkpoint",
    "source_config",
]

log = logging.getLogger(__name__)


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
        params = init_params(cfg, key)
    return place_params(ParamTreeReader(params), cfg, layout, cfg.dtype)
