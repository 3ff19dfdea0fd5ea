"""OPT model shapes: the one place the planner and the runtime learn a model's size.

Pure Python on purpose (no JAX import): the placement planner reads parameter
counts, KV-cache bytes per token and FLOPs per token from here without starting
an accelerator runtime.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

OPT_VOCAB_SIZE = 50272
OPT_MAX_POSITIONS = 2048
# OPT's learned position table has two extra rows: position p reads row p + 2.
OPT_POSITION_OFFSET = 2

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class OPTConfig:
    """Shape of an OPT decoder (the fields Hugging Face's OPTConfig uses)."""

    name: str
    hidden_size: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    vocab_size: int = OPT_VOCAB_SIZE
    max_position_embeddings: int = OPT_MAX_POSITIONS
    word_embed_proj_dim: int | None = None  # None means == hidden_size
    do_layer_norm_before: bool = True
    layer_norm_eps: float = 1e-5
    pad_token_id: int = 1
    bos_token_id: int = 2
    eos_token_id: int = 2
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"{self.name}: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"{self.name}: dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}")

    # ---- derived shapes -------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (OPT-350m projects 512 -> 1024)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def has_projections(self) -> bool:
        return self.embed_dim != self.hidden_size

    @property
    def has_final_layer_norm(self) -> bool:
        # Hugging Face builds final_layer_norm only for the pre-LN variant.
        return self.do_layer_norm_before

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def with_dtype(self, dtype: str) -> OPTConfig:
        return dataclasses.replace(self, dtype=dtype)

    # ---- sizes the planner needs ----------------------------------------
    @property
    def num_layer_params(self) -> int:
        """Parameters of one decoder layer (attention, FFN, two LayerNorms)."""
        h, f = self.hidden_size, self.ffn_dim
        attention = 4 * h * h + 4 * h
        ffn = h * f + f + f * h + h
        layer_norms = 2 * 2 * h
        return attention + ffn + layer_norms

    @property
    def num_embedding_params(self) -> int:
        """Token and position tables, projections and the final LayerNorm (LM head is tied)."""
        tokens = self.vocab_size * self.embed_dim
        positions = (self.max_position_embeddings + OPT_POSITION_OFFSET) * self.hidden_size
        projections = 2 * self.embed_dim * self.hidden_size if self.has_projections else 0
        final_ln = 2 * self.hidden_size if self.has_final_layer_norm else 0
        return tokens + positions + projections + final_ln

    @property
    def num_params(self) -> int:
        return self.num_layers * self.num_layer_params + self.num_embedding_params

    @property
    def param_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token across all layers."""
        return 2 * self.num_layers * self.hidden_size * self.dtype_bytes

    def flops_per_token(self, context_len: int = 0) -> int:
        """Forward FLOPs for one token attending to `context_len` earlier tokens.

        2 FLOPs per multiply-add over every matmul weight (LM head included), plus
        the attention score and value products (2·2·h·ctx per layer).
        """
        matmul_params = self.num_layers * (4 * self.hidden_size**2 + 2 * self.hidden_size * self.ffn_dim)
        lm_head = self.vocab_size * self.embed_dim
        projections = 2 * self.embed_dim * self.hidden_size if self.has_projections else 0
        attention = self.num_layers * 4 * self.hidden_size * context_len
        return 2 * (matmul_params + lm_head + projections) + attention

    # ---- Hugging Face interop -------------------------------------------
    @classmethod
    def from_hf_config(cls, source: str | Path | dict[str, Any], name: str | None = None) -> OPTConfig:
        """Build from a Hugging Face `config.json` (a path, a directory holding one, or the dict)."""
        if isinstance(source, dict):
            raw = source
            default_name = str(raw.get("_name_or_path") or "opt")
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            raw = json.loads(path.read_text())
            default_name = path.parent.name
        model_type = raw.get("model_type", "opt")
        if model_type != "opt":
            raise ValueError(f"expected an OPT config (model_type 'opt'), got model_type {model_type!r}")
        activation = raw.get("activation_function", "relu")
        if activation != "relu":
            raise ValueError(f"only ReLU OPT models are supported, config has activation_function {activation!r}")
        if raw.get("_remove_final_layer_norm", False):
            raise ValueError("configs with _remove_final_layer_norm=True are not supported")
        if not raw.get("enable_bias", True) or not raw.get("layer_norm_elementwise_affine", True):
            raise ValueError("OPT configs without biases or LayerNorm affine parameters are not supported")
        hidden = int(raw["hidden_size"])
        proj = raw.get("word_embed_proj_dim")
        torch_dtype = str(raw.get("torch_dtype") or "float32")
        return cls(
            name=name or default_name,
            hidden_size=hidden,
            ffn_dim=int(raw["ffn_dim"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            vocab_size=int(raw.get("vocab_size", OPT_VOCAB_SIZE)),
            max_position_embeddings=int(raw.get("max_position_embeddings", OPT_MAX_POSITIONS)),
            word_embed_proj_dim=None if proj in (None, hidden) else int(proj),
            do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-5)),
            pad_token_id=int(raw.get("pad_token_id", 1)),
            bos_token_id=int(raw.get("bos_token_id", 2)),
            eos_token_id=int(raw.get("eos_token_id", 2)),
            dtype=torch_dtype if torch_dtype in _DTYPE_BYTES else "float32",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` fields Hugging Face's OPTConfig reads."""
        return {
            "model_type": "opt",
            "architectures": ["OPTForCausalLM"],
            "hidden_size": self.hidden_size,
            "ffn_dim": self.ffn_dim,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "word_embed_proj_dim": self.embed_dim,
            "do_layer_norm_before": self.do_layer_norm_before,
            "layer_norm_eps": self.layer_norm_eps,
            "activation_function": "relu",
            "enable_bias": True,
            "layer_norm_elementwise_affine": True,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.dtype,
        }


def _preset(name: str, hidden: int, ffn: int, layers: int, heads: int, **kw: Any) -> OPTConfig:
    return OPTConfig(name=name, hidden_size=hidden, ffn_dim=ffn, num_layers=layers, num_heads=heads, **kw)


# Shapes of the published facebook/opt-* checkpoints.
PRESETS: dict[str, OPTConfig] = {
    c.name: c
    for c in (
        _preset("opt-125m", 768, 3072, 12, 12),
        _preset("opt-350m", 1024, 4096, 24, 16, word_embed_proj_dim=512, do_layer_norm_before=False),
        _preset("opt-1.3b", 2048, 8192, 24, 32),
        _preset("opt-2.7b", 2560, 10240, 32, 32),
        _preset("opt-6.7b", 4096, 16384, 32, 32),
        _preset("opt-13b", 5120, 20480, 40, 40),
        _preset("opt-30b", 7168, 28672, 48, 56),
        _preset("opt-66b", 9216, 36864, 64, 72),
        _preset("opt-175b", 12288, 49152, 96, 96),
        # Test-sized models: a pre-LN one and a post-LN one with project_in/out.
        _preset("opt-tiny", 64, 256, 2, 4, vocab_size=512, max_position_embeddings=256),
        # Small enough for CI, large enough that a CPU core spends its time in the model rather than in
        # host overhead (prefill of 256 tokens ~ tens of ms): the simulator-vs-engine checks run on it.
        _preset("opt-mini", 256, 1024, 4, 4, vocab_size=512, max_position_embeddings=1024),
        _preset(
            "opt-tiny-postln",
            64,
            256,
            2,
            4,
            vocab_size=512,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
    )
}


def get_config(name: str, dtype: str | None = None) -> OPTConfig:
    """A preset by name (`opt-13b`, `13b`, `facebook/opt-13b` all work)."""
    key = name.lower().removeprefix("facebook/")
    if not key.startswith("opt-"):
        key = f"opt-{key}"
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    config = PRESETS[key]
    return config.with_dtype(dtype) if dtype else config
