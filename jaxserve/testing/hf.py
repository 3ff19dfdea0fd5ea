"""Random Hugging Face checkpoints (OPT, Llama-style) for tests and benchmarks (no model hub needed).

`transformers` and `torch` are imported inside the functions: they are test dependencies only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.config import LlamaConfig, ModelConfig, OPTConfig


def hf_opt_config(cfg: OPTConfig) -> Any:
    """A `transformers.OPTConfig` with the shape of `cfg`."""
    import transformers

    return transformers.OPTConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        ffn_dim=cfg.ffn_dim,
        num_attention_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        do_layer_norm_before=cfg.do_layer_norm_before,
        word_embed_proj_dim=cfg.embed_dim,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        activation_function="relu",
        dropout=0.0,
        attention_dropout=0.0,
        tie_word_embeddings=True,
    )


def make_hf_model(cfg: ModelConfig, seed: int = 0) -> Any:
    """A random float32 `transformers` model of shape `cfg` (`OPTForCausalLM`, or the Llama-style family's
    `*ForCausalLM`), in eval mode.

    Biases and norm parameters are randomised too (HF initialises them to 0/1), so a
    parity test exercises every tensor.
    """
    import torch
    import transformers

    torch.manual_seed(seed)
    if isinstance(cfg, LlamaConfig):
        return _make_hf_llama(cfg, seed)
    model: Any = transformers.OPTForCausalLM(hf_opt_config(cfg))
    model = model.float().eval()  # HF OPT LayerNorms use the fixed eps 1e-5, as does OPTConfig's default
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            elif "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_positions" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def make_hf_checkpoint(
    path: str | Path, cfg: OPTConfig, seed: int = 0, sharded: bool = False, safetensors: bool = True
) -> Path:
    """Save a random `OPTForCausalLM` of shape `cfg` to `path` with `save_pretrained`; returns `path`.

    `sharded=True` uses a small `max_shard_size` so the checkpoint is split with an index file.
    `safetensors=False` writes `pytorch_model.bin` instead.
    """
    path = Path(path)
    model = make_hf_model(cfg, seed)
    if not safetensors:
        # transformers 5 always writes safetensors; older checkpoints ship pytorch_model.bin.
        import torch

        path.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(path)
        torch.save(model.state_dict(), path / "pytorch_model.bin")
        return path
    kwargs: dict[str, Any] = {}
    if sharded:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        kwargs["max_shard_size"] = max(total // 4, 1024)
    model.save_pretrained(path, **kwargs)
    return path


def hf_logprobs(model: Any, prompt: Sequence[int], output: Sequence[int]) -> Any:
    """Hugging Face's log_softmax of the logits that predicted each token of `output` after `prompt`.

    A float64 numpy array [len(output), V]: row i is the distribution output[i] was drawn from.
    """
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(output)])).logits[0].double()  # [T, V]
    logp = torch.log_softmax(logits, dim=-1).numpy()
    return logp[len(prompt) - 1 : len(prompt) - 1 + len(output)]


def _make_hf_llama(cfg: LlamaConfig, seed: int) -> Any:
    import transformers

    fields = {k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf_cfg = transformers.AutoConfig.for_model(cfg.family, **fields)
    model: Any = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    return randomize_llama(model, seed, weight_scale=0.02, bias_scale=0.02)


def randomize_llama(model: Any, seed: int, weight_scale: float, bias_scale: float) -> Any:
    """Every tensor of a Llama-style `model` random, from generator `seed + 1` in parameter order: biases and
    matrices normal with their scale, norm scales 1 + 0.1 x normal (HF initialises those to 0 / 1, so a
    parity test would not exercise them). Returns the model."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(bias_scale * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(weight_scale * torch.randn(p.shape, generator=gen))
    return model
