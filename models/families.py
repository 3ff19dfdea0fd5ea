"""The model families: which `flax.nnx` model class (`models.opt.OPT`, `models.llama.Llama`) runs a config.

A family is one file holding its model class (the layers as `flax.nnx` modules, each parameter tagged with its
logical axes) and its Hugging Face tensor names (`HF_NAMING`, a class attribute); docs/models.md lists what
it defines. Registering a family is one line here.
"""

from __future__ import annotations

from typing import Any

from models import llama, opt
from models.config import LlamaConfig, ModelConfig, OPTConfig

FAMILIES: dict[type, type[Any]] = {OPTConfig: opt.OPT, LlamaConfig: llama.Llama}


def model_class(cfg: ModelConfig) -> type[Any]:
    """The `flax.nnx` model class (`opt.OPT`, `llama.Llama`) of `cfg`'s family."""
    return FAMILIES[type(cfg)]
