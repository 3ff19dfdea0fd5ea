"""The model families: which module (`models.opt`, `models.llama`) runs a config, by the config's type.

A family module holds its layers, its param shapes and specs, its random init and its Hugging Face tensor names
(`HF_NAMING`); docs/models.md lists what it defines. Registering a family is one line here.
"""

from __future__ import annotations

from types import ModuleType

from models import llama, opt
from models.config import LlamaConfig, ModelConfig, OPTConfig

FAMILIES: dict[type, ModuleType] = {OPTConfig: opt, LlamaConfig: llama}


def family(cfg: ModelConfig) -> ModuleType:
    """The model module (`models.opt` or `models.llama`) whose functions run `cfg`."""
    return FAMILIES[type(cfg)]
