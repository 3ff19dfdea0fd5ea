"""Model shapes (OPT, Llama-style): the one place the planner and the runtime learn a model's size.

Pure Python on purpose (no JAX import): the placement planner reads parameter
counts, KV-cache bytes per token and FLOPs per token from here without starting
an accelerator runtime.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Self

OPT_VOCAB_SIZE = 50272
OPT_MAX_POSITIONS = 2048
# OPT's learned position table has two extra rows: position p reads row p + 2.
OPT_POSITION_OFFSET = 2

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class DecoderConfig:
    """What every family's config is: a frozen, hashable dataclass (a static jit argument) of a decoder's shape.

    The shared members live here once; a family's config (`OPTConfig`, `LlamaConfig`) adds its fields, its
    per-layer and embedding parameter counts, its KV bytes and FLOPs per token, and its Hugging Face mapping.
    """

    name: str
    num_layers: int
    num_heads: int
    hidden_size: int
    vocab_size: int
    dtype: str

    @property
    def head_dim(self) -> int:
        raise NotImplementedError

    @property
    def kv_heads(self) -> int:
        """K/V heads per layer."""
        raise NotImplementedError

    @property
    def num_layer_params(self) -> int:
        """Parameters of one decoder layer."""
        raise NotImplementedError

    @property
    def num_embedding_params(self) -> int:
        """Parameters outside the decoder layers (embeddings, final norm, an untied head)."""
        raise NotImplementedError

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    def with_dtype(self, dtype: str) -> Self:
        return dataclasses.replace(self, dtype=dtype)  # type: ignore[type-var]

    def _dtype_problems(self) -> list[str]:
        return (
            [] if self.dtype in _DTYPE_BYTES else [f"dtype must be one of {sorted(_DTYPE_BYTES)}, got {self.dtype!r}"]
        )

    # ---- sizes the planner needs ----------------------------------------
    @property
    def num_params(self) -> int:
        return self.num_layers * self.num_layer_params + self.num_embedding_params

    @property
    def param_bytes(self) -> int:
        return self.num_params * self.dtype_bytes


@dataclasses.dataclass(frozen=True)
class OPTConfig(DecoderConfig):
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
        if self._dtype_problems():
            raise ValueError(f"{self.name}: " + "; ".join(self._dtype_problems()))

    # ---- derived shapes -------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """K/V heads per layer (OPT is multi-head: one per query head)."""
        return self.num_heads

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends a sequence (OPT has one)."""
        return (self.eos_token_id,)

    @property
    def filler_token_id(self) -> int:
        """A real token id to pad batches and warm programs with (its values are never read)."""
        return self.pad_token_id

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


# ------------------------------------------------------------------------------------------------
# Llama-style decoders (Llama, Qwen2, Mistral): RMSNorm, RoPE, grouped K/V heads, SwiGLU MLP
# ------------------------------------------------------------------------------------------------


class UnsupportedModelError(ValueError):
    """A checkpoint's architecture or one of its options is not one jaxserve implements (raised before loading)."""


class CheckpointError(ValueError):
    """A checkpoint is missing a tensor, has one of the wrong shape, or cannot be read.

    Here, beside `UnsupportedModelError`, so every checkpoint reader (`models.checkpoint`, `models.gguf`) raises it.
    """


# Hugging Face architecture -> our family name. A family here differs only in config mapping.
LLAMA_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}
_MODEL_TYPES = {family: family for family in LLAMA_ARCHITECTURES.values()}
ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """`rope_scaling` of type "linear" (positions divided by `factor`) or "llama3" (frequency bands)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise UnsupportedModelError(
                f"rope_scaling type {self.rope_type!r} is not supported (supported: 'linear', 'llama3')"
            )
        if self.factor <= 0:
            raise UnsupportedModelError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise UnsupportedModelError(
                f"llama3 rope_scaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig(DecoderConfig):
    """Shape of a Llama-style decoder; `from_hf_config` maps Llama, Qwen2 and Mistral `config.json`s onto it.

    Hashable (frozen, tuples only): the model functions take it as a static jit argument.
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim_: int | None = None  # None means hidden_size // num_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False  # Qwen2: q/k/v projections have biases
    o_bias: bool = False  # Llama's attention_bias=True: o_proj too
    tie_word_embeddings: bool = False
    family: str = "llama"
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    pad_token_id: int | None = None
    dtype: str = "float32"

    def __post_init__(self) -> None:
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                            f"{self.num_kv_heads}")  # fmt: skip
        if self.head_dim_ is None and self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim {self.head_dim} is odd (RoPE rotates pairs)")
        problems += self._dtype_problems()
        if problems:
            raise ValueError(f"{self.name}: " + "; ".join(problems))

    # ---- derived shapes -------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.head_dim_ if self.head_dim_ is not None else self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads

    @property
    def num_groups(self) -> int:
        """Query heads per K/V head (1: MHA; num_heads: MQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def ffn_dim(self) -> int:
        """The MLP's inner width (the name the planner reads)."""
        return self.intermediate_size

    @property
    def embed_dim(self) -> int:
        return self.hidden_size

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def filler_token_id(self) -> int:
        """A real token id to pad batches and warm programs with: pad, else BOS, else 0 (values never read)."""
        for token in (self.pad_token_id, self.bos_token_id):
            if token is not None:
                return token
        return 0

    # ---- sizes the planner needs ----------------------------------------
    @property
    def num_layer_params(self) -> int:
        """Parameters of one decoder layer (q/k/v/o, gate/up/down, two RMSNorm scales)."""
        h = self.hidden_size
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        attention += (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        attention += h if self.o_bias else 0
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def num_embedding_params(self) -> int:
        """Token table, final RMSNorm and an untied LM head (RoPE has no parameters)."""
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.vocab_size * self.hidden_size + self.hidden_size + head

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V for one token across all layers: `kv_heads * head_dim` each, not `hidden_size`."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes

    def flops_per_token(self, context_len: int = 0) -> int:
        """Forward FLOPs for one token attending to `context_len` earlier tokens (2 per multiply-add)."""
        h = self.hidden_size
        matmul_params = self.num_layers * (2 * h * self.q_dim + 2 * h * self.kv_dim + 3 * h * self.intermediate_size)
        lm_head = self.vocab_size * h
        attention = self.num_layers * 4 * self.q_dim * context_len  # every query head scores and weighs
        return 2 * (matmul_params + lm_head) + attention

    # ---- Hugging Face interop -------------------------------------------
    @classmethod
    def from_hf_config(cls, source: str | Path | dict[str, Any], name: str | None = None) -> LlamaConfig:
        """Build from a Hugging Face `config.json` (a path, a directory holding one, or the dict).

        Raises `UnsupportedModelError` naming the architecture or option when it is not one we
        implement (sliding-window attention, a RoPE type other than default/linear/llama3, ...).
        """
        raw, default_name = _read_hf_config(source)
        family = _llama_family(raw)
        problems = []
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            problems.append(f"hidden_act {act!r} (only 'silu', the SwiGLU MLP)")
        if raw.get("mlp_bias"):
            problems.append("mlp_bias=True")
        if family == "mistral" and raw.get("sliding_window") is not None:
            problems.append(f"sliding_window={raw['sliding_window']} (sliding-window attention)")
        if family == "qwen2" and raw.get("use_sliding_window"):
            problems.append("use_sliding_window=True (sliding-window attention)")
        other_layers = sorted({t for t in raw.get("layer_types") or () if t != "full_attention"})
        if other_layers:
            problems.append(f"layer_types {other_layers} (only full_attention)")
        rope_theta, rope_scaling, rope_problems = _rope_from_hf(raw)
        problems.extend(rope_problems)
        if problems:
            arch = (raw.get("architectures") or [family])[0]
            raise UnsupportedModelError(f"{arch} config not supported: " + "; ".join(problems))
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        torch_dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32")
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim")
        return cls(
            name=name or default_name,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            vocab_size=int(raw["vocab_size"]),
            head_dim_=None if head_dim in (None, hidden // heads) else int(head_dim),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            family=family,
            bos_token_id=None if raw.get("bos_token_id") is None else int(raw["bos_token_id"]),
            eos_token_ids=eos_ids,
            pad_token_id=None if raw.get("pad_token_id") is None else int(raw["pad_token_id"]),
            dtype=torch_dtype if torch_dtype in _DTYPE_BYTES else "float32",
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` fields `from_hf_config` reads (transformers 4 spelling of RoPE)."""
        arch = next(a for a, f in LLAMA_ARCHITECTURES.items() if f == self.family)
        rope_scaling = None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
        return {
            "model_type": self.family,
            "architectures": [arch],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope_scaling,
            "attention_bias": self.o_bias,
            "hidden_act": "silu",
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
        }


def _read_hf_config(source: str | Path | dict[str, Any]) -> tuple[dict[str, Any], str]:
    if isinstance(source, dict):
        return source, str(source.get("_name_or_path") or source.get("model_type") or "model")
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text()), path.parent.name


def _llama_family(raw: dict[str, Any]) -> str:
    """The family of a config's first architecture (or its model_type when architectures is absent)."""
    archs = raw.get("architectures") or []
    if archs:
        if archs[0] not in LLAMA_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {archs[0]!r} is not supported (supported: {', '.join(LLAMA_ARCHITECTURES)}, "
                "OPTForCausalLM)"
            )
        return LLAMA_ARCHITECTURES[archs[0]]
    model_type = raw.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(_MODEL_TYPES)}, opt)"
        )
    return _MODEL_TYPES[str(model_type)]


def _rope_from_hf(raw: dict[str, Any]) -> tuple[float, RopeScaling | None, list[str]]:
    """(rope_theta, scaling, problems) from `rope_theta` + `rope_scaling` (transformers 4) or `rope_parameters` (5)."""
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {}) or params
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    problems = []
    if float(scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        problems.append("partial_rotary_factor != 1 (partial RoPE)")
    if rope_type not in ROPE_TYPES:
        problems.append(f"rope_scaling type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        return theta, None, problems
    if rope_type == "default":
        return theta, None, problems
    keys = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra: dict[str, Any] = {k: scaling[k] for k in keys if rope_type == "llama3" and k in scaling}
    return theta, RopeScaling(rope_type=rope_type, factor=float(scaling.get("factor", 1.0)), **extra), problems


ModelConfig = OPTConfig | LlamaConfig


def config_from_hf(source: str | Path | dict[str, Any], name: str | None = None) -> ModelConfig:
    """The config of any supported Hugging Face `config.json`: OPT or a Llama-style family.

    Anything else is an `UnsupportedModelError` that names the architecture, before any weight loads.
    """
    raw, _ = _read_hf_config(source)
    archs = raw.get("architectures") or []
    if raw.get("model_type") == "opt" or (archs and archs[0] == "OPTForCausalLM"):
        return OPTConfig.from_hf_config(source, name=name)
    return LlamaConfig.from_hf_config(source, name=name)


def _llama_preset(
    name: str, hidden: int, inter: int, layers: int, heads: int, kv: int, vocab: int, **kw: Any
) -> LlamaConfig:
    return LlamaConfig(name=name, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, vocab_size=vocab, **kw)  # fmt: skip


_LLAMA3_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
_LLAMA3_IDS: dict[str, Any] = {"bos_token_id": 128000, "eos_token_ids": (128001, 128008, 128009)}

# Shapes of published Llama-style checkpoints (for the planner: sizes only), and a test-sized one.
LLAMA_PRESETS: dict[str, LlamaConfig] = {
    c.name: c
    for c in (
        _llama_preset("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, **_LLAMA3_IDS),
        _llama_preset("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128256, max_position_embeddings=131072,
                      rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, **_LLAMA3_IDS),
        _llama_preset("qwen2-7b", 3584, 18944, 28, 28, 4, 152064, max_position_embeddings=32768,
                      rope_theta=1000000.0, qkv_bias=True, family="qwen2", bos_token_id=None,
                      eos_token_ids=(151643,)),
        _llama_preset("mistral-7b-v0.3", 4096, 14336, 32, 32, 8, 32768, max_position_embeddings=32768,
                      rms_norm_eps=1e-5, rope_theta=1000000.0, family="mistral"),
        # SmolLM2-135M(-Instruct): GQA 9:3, tied head; the model `jaxserve pull smollm2-135m-instruct` fetches
        _llama_preset("smollm2-135m", 576, 1536, 30, 9, 3, 49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,),
                      pad_token_id=2),
        _llama_preset("llama-tiny", 64, 128, 2, 4, 2, 512, max_position_embeddings=256),
    )
}  # fmt: skip


def get_llama_config(name: str, dtype: str | None = None) -> LlamaConfig:
    """A Llama-style preset by name (`llama-3.1-8b`, `qwen2-7b`, `mistral-7b-v0.3`, `llama-tiny`)."""
    key = name.lower().split("/")[-1]
    if key not in LLAMA_PRESETS:
        raise KeyError(f"unknown Llama-style preset {name!r}; known: {', '.join(LLAMA_PRESETS)}")
    config = LLAMA_PRESETS[key]
    return config.with_dtype(dtype) if dtype else config


def get_model_config(name: str, dtype: str | None = None) -> ModelConfig:
    """A preset of either family by name: `opt-13b` (or `13b`, `facebook/opt-13b`) or `llama-3.1-70b`, `qwen2-7b`, ..."""
    key = name.lower().split("/")[-1]
    if key in LLAMA_PRESETS:
        return get_llama_config(key, dtype)
    try:
        return get_config(name, dtype)
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join([*PRESETS, *LLAMA_PRESETS])}") from None


# ------------------------------------------------------------------------------------------------
# Tensor parallelism: which degrees shard a model and what one device then holds (the planner's sizes;
# the runtime's `models.sharding` lays the weights out by the same rule)
# ------------------------------------------------------------------------------------------------


def tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    """Why `tp` devices cannot shard `cfg`'s layers (empty: they can).

    Query heads and the MLP's inner width split `tp` ways. K/V heads split when `tp` divides them, and are
    replicated on every device of the group when `tp` is a multiple of them (Llama-3.1-70B's 8 K/V heads at
    tp 16); any other `tp` (qwen2-7b's 4 K/V heads at tp 6) would leave devices with parts of a K/V head.
    """
    problems = []
    if tp < 1:
        return [f"tp must be >= 1, got {tp}"]
    if cfg.num_heads % tp:
        problems.append(f"num_heads {cfg.num_heads} is not divisible by tp={tp}")
    if cfg.kv_heads % tp and tp % cfg.kv_heads:
        problems.append(
            f"{cfg.kv_heads} K/V heads neither split over tp={tp} (tp must divide them) "
            f"nor replicate across it (tp must be a multiple of them)"
        )
    if cfg.ffn_dim % tp:
        problems.append(f"ffn_dim {cfg.ffn_dim} is not divisible by tp={tp}")
    return problems


def supports_tp(cfg: ModelConfig, tp: int) -> bool:
    return not tp_problems(cfg, tp)


def kv_heads_split(cfg: ModelConfig, tp: int) -> bool:
    """Whether K/V heads split over `tp` (tp divides them) or are replicated (tp a multiple of them)."""
    if tp >= 1 and cfg.kv_heads % tp == 0:
        return True
    if tp >= 1 and tp % cfg.kv_heads == 0:
        return False
    raise ValueError(
        f"cannot shard {cfg.name} with tp={tp}: {cfg.kv_heads} K/V heads neither split over tp={tp} "
        f"(tp must divide them) nor replicate across it (tp must be a multiple of them)"
    )


def kv_heads_per_device(cfg: ModelConfig, tp: int) -> int:
    """K/V heads one device of a `tp` group stores: its share when they split, all of them when replicated."""
    return cfg.kv_heads // tp if kv_heads_split(cfg, tp) else cfg.kv_heads


def kv_heads_read_per_device(cfg: ModelConfig, tp: int) -> int:
    """K/V heads one device's attention reads: its share, or (replicated) the one its query heads use.

    With tp a multiple of the K/V heads each device's `num_heads / tp` query heads fall inside one group, so
    attention reads one K/V head although the device stores them all.
    """
    return cfg.kv_heads // tp if kv_heads_split(cfg, tp) else 1


def layer_matmul_params(cfg: ModelConfig) -> tuple[int, int]:
    """Weights of one layer's matmuls as (q/o projections + MLP, k/v projections).

    Attention: `h·q_dim + 2·h·kv_dim + q_dim·h` (OPT: 4h²); MLP: `2·h·ffn` (OPT: fc1, fc2) or `3·h·ffn`
    (Llama-style SwiGLU: gate, up, down). The k/v part is what tp may replicate.
    """
    h = cfg.hidden_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    mlp = (3 if isinstance(cfg, LlamaConfig) else 2) * h * cfg.ffn_dim
    return 2 * h * q_dim + mlp, 2 * h * kv_dim


def replicated_layer_params(cfg: ModelConfig, tp: int) -> int:
    """Parameters of one layer every device of a `tp` group holds whole: the k/v projections (and their
    biases) when K/V heads are replicated, else none."""
    if kv_heads_split(cfg, tp):
        return 0
    kv_dim = cfg.kv_heads * cfg.head_dim
    bias = 2 * kv_dim if isinstance(cfg, LlamaConfig) and cfg.qkv_bias else 0
    return layer_matmul_params(cfg)[1] + bias
