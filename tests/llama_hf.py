"""Random tiny Hugging Face Llama / Qwen2 / Mistral checkpoints for the Llama-family tests (no hub access).

`make_hf_llama(kind)` builds a float32 `*ForCausalLM` with every tensor randomised (biases and
RMSNorm scales too, which Hugging Face initialises to 0 / 1), so a parity test exercises each one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxserve.testing.hf import randomize_llama

# Each variant covers a different corner: GQA + llama3 RoPE; MHA-width q with a head_dim that is not
# hidden / heads, linear RoPE, biases everywhere; MQA, tied head, Qwen2's q/k/v biases; plain MHA Mistral.
KINDS = ("llama-gqa-llama3", "llama-headdim-linear-bias", "qwen2-mqa-tied", "mistral-mha")
_COMMON: dict[str, Any] = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def hf_config(kind: str) -> Any:
    """The `transformers` config of one of `KINDS`."""
    import transformers

    if kind == "llama-gqa-llama3":
        return transformers.LlamaConfig(
            **_COMMON,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,  # wavelengths 6..19000: all three bands in play
            },
        )
    if kind == "llama-headdim-linear-bias":
        return transformers.LlamaConfig(
            **_COMMON,
            num_key_value_heads=2,
            head_dim=32,  # q is 4 * 32 = 128 wide, not hidden_size 64
            attention_bias=True,
            rope_theta=500.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        )
    if kind == "qwen2-mqa-tied":
        return transformers.Qwen2Config(**_COMMON, num_key_value_heads=1, tie_word_embeddings=True)
    if kind == "mistral-mha":
        return transformers.MistralConfig(**_COMMON, num_key_value_heads=4, sliding_window=None)
    raise KeyError(kind)


def make_hf_llama(kind: str, seed: int = 0) -> Any:
    """A random float32 model of `kind`, eval mode, all tensors random (biases, norm scales included)."""
    import torch
    import transformers

    config = hf_config(kind)
    torch.manual_seed(seed)
    model: Any = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model = model.float().eval()
    return randomize_llama(model, seed, weight_scale=0.08, bias_scale=0.1)


def save_hf_llama(model: Any, path: Path, dtype: str = "float32", max_shard_size: str | None = None) -> Path:
    """`save_pretrained` (safetensors) in `dtype`; `max_shard_size` splits it into an indexed multi-file checkpoint."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.to(getattr(torch, dtype)).save_pretrained(path, **kwargs)
    model.float()
    return path
