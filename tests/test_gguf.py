"""GGUF checkpoints against `transformers`' own GGUF loader (an independent reader and dequantizer).

Tiny random Llama (GQA) and Qwen2 (MQA, tied head, q/k/v biases) models are written with
`gguf.GGUFWriter` as llama.cpp's converter writes them: llama's q/k rows permuted for its rotary
pairing, 1-D tensors in F32, matrices in F32/F16/BF16/Q8_0/Q4_0/Q4_1 (quantized by `gguf.quants`),
and, since that package cannot quantize K-quants, hand-built Q4_K/Q5_K/Q6_K blocks in one file.
Our loader's params, run through `models.llama`, must give `transformers`'
`from_pretrained(dir, gguf_file=...)`'s logits and greedy tokens. Then: the tokenizer the file
describes against `AutoTokenizer` on the same file, tp=2 loading, and one clear error per bad file.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers needs it to load a GGUF file

from jaxserve.testing.hf import randomize_llama  # noqa: E402
from models import (  # noqa: E402
    checkpoint,
    steps,
)
from models.attention import DecodeCache  # noqa: E402
from models.checkpoint import CheckpointError  # noqa: E402
from models.config import LlamaConfig, UnsupportedModelError  # noqa: E402
from models.quant import QuantizedWeight  # noqa: E402
from models.sharding import ShardedLlama  # noqa: E402

Q = gguf.GGMLQuantizationType
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t", "Ġ w"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_alphabet() -> list[str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


TOKENS = SPECIALS + _byte_alphabet() + [m.replace(" ", "") for m in MERGES]  # 5 + 256 + 11 = 272
VOCAB = len(TOKENS)


def _hf_model(family: str, seed: int, layers: int = 2, **extra: Any) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, **extra,
    )  # fmt: skip
    if family == "llama":
        config = transformers.LlamaConfig(**common, num_key_value_heads=2)
    else:
        config = transformers.Qwen2Config(**common, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    return randomize_llama(model, seed, weight_scale=0.08, bias_scale=0.1)


def _permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py permutation of q/k rows (per head: halves -> interleaved pairs)."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_GGUF_LAYER[rest]}"


def _k_quant_blocks(qtype: Any, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid random K-quant blocks: random quants and scales, small finite f16 super-block scales."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // block_elems, block_bytes), dtype=np.uint8)
    d = np.full((rows, cols // block_elems, 1), 4e-4, np.float16).view(np.uint8)  # [.., 2] little-endian bytes
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[..., 208:210] = d
    else:  # Q4_K / Q5_K: d, dmin, scales[12], (qh[32],) qs[128]
        raw[..., 0:2] = d
        raw[..., 2:4] = np.full((rows, cols // block_elems, 1), 2e-3, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write_gguf(
    model: Any,
    path: Path,
    qtype: Any = Q.F32,
    *,
    k_quants: tuple[Any, ...] = (),
    arch: str | None = None,
    skip: tuple[str, ...] = (),
    extra: dict[str, tuple[np.ndarray, Any]] | None = None,
    metadata: dict[str, Any] | None = None,
    end_ids: dict[str, int] | None = None,
) -> Path:
    """`model` as llama.cpp would write it; `k_quants[i]` is layer i's ffn_down type (hand-built blocks)."""
    hc = model.config
    family = hc.model_type
    arch = arch or family
    heads, kv_heads = hc.num_attention_heads, hc.num_key_value_heads
    head_dim = hc.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    meta = {
        "block_count": hc.num_hidden_layers,
        "context_length": hc.max_position_embeddings,
        "embedding_length": hc.hidden_size,
        "feed_forward_length": hc.intermediate_size,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "rope.freq_base": float(hc.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(hc.rms_norm_eps),
        **(metadata or {}),
    }
    for key, value in meta.items():
        if isinstance(value, float):
            w.add_float32(f"{arch}.{key}", value)
        elif isinstance(value, str):
            w.add_string(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    if family == "llama":
        w.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3] * len(SPECIALS) + [1] * (VOCAB - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    for key, token in (end_ids or {}).items():  # eot_token_id, eom_token_id: more ends of generation
        w.add_uint32(f"tokenizer.ggml.{key}", token)
    w.add_add_bos_token(family == "llama")
    w.add_chat_template(CHAT_TEMPLATE)
    for hf_name, tensor in model.state_dict().items():
        if family == "qwen2" and hf_name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        name = _gguf_name(hf_name)
        if name in skip:
            continue
        data = tensor.detach().float().numpy()
        if family == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):  # as convert_hf_to_gguf.py
            data = _permute(data, heads, heads)
        elif family == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            data = _permute(data, heads, kv_heads)
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name.endswith("ffn_down.weight") and layer < len(k_quants):
            w.add_tensor(
                name,
                _k_quant_blocks(k_quants[layer], data.shape[0], data.shape[1], seed=layer),
                raw_dtype=k_quants[layer],
            )
        elif data.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, data.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    for name, (data, raw_dtype) in (extra or {}).items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _hf_from_gguf(path: Path) -> Any:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _greedy_ours(params: Any, cfg: LlamaConfig, prompt: np.ndarray, num_new: int) -> list[int]:
    """Prefill, then cached decode steps (fixed shapes: compiled once)."""
    logits, kv = steps.prefill(params, cfg, jnp.asarray(prompt[None]), jnp.asarray([len(prompt)], jnp.int32))
    cache = DecodeCache.from_kv(kv, len(prompt) + num_new)
    out, pos = [], jnp.asarray([len(prompt)], jnp.int32)
    tok = jnp.argmax(logits, -1).astype(jnp.int32)
    for _ in range(num_new):
        out.append(int(tok[0]))
        logits, cache = steps.decode(params, cfg, tok, pos, cache)
        tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
    return out


def _greedy_hf(hf: Any, prompt: np.ndarray, num_new: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(
            torch.from_numpy(prompt[None]).long(), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


PROMPT = np.array([1, 40, 77, 100, 260, 5, 9, 150, 33], np.int32)


@pytest.mark.parametrize(
    ("family", "qtype"),
    [
        # the default run keeps one float and one block-quantized type per family; .ci/run's slow part the rest
        ("llama", Q.F32),
        pytest.param("llama", Q.F16, marks=pytest.mark.slow),
        pytest.param("llama", Q.BF16, marks=pytest.mark.slow),
        pytest.param("llama", Q.Q8_0, marks=pytest.mark.slow),
        pytest.param("llama", Q.Q4_0, marks=pytest.mark.slow),
        ("llama", Q.Q4_1),
        pytest.param("qwen2", Q.F32, marks=pytest.mark.slow),
        ("qwen2", Q.Q8_0),
        pytest.param("qwen2", Q.Q4_1, marks=pytest.mark.slow),
    ],
    ids=lambda v: v if isinstance(v, str) else v.name,
)
def test_logits_and_greedy_tokens_match_transformers_reading_the_same_file(
    family: str, qtype: Any, tmp_path: Path
) -> None:
    path = write_gguf(_hf_model(family, seed=3), tmp_path / "m.gguf", qtype)
    cfg = checkpoint.source_config(path)
    assert isinstance(cfg, LlamaConfig)
    assert (cfg.family, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (family, 4, 2 if family == "llama" else 1,
                                                                             VOCAB)  # fmt: skip
    assert cfg.tie_word_embeddings == (family == "qwen2") and cfg.qkv_bias == (family == "qwen2")
    params = checkpoint.load_gguf_params(path, cfg)
    hf = _hf_from_gguf(path)

    ids = jnp.asarray(PROMPT[None])
    ours, _ = steps.prefill(params, cfg, ids, jnp.asarray([len(PROMPT)], jnp.int32), all_logits=True)
    with torch.inference_mode():
        ref = hf(torch.from_numpy(PROMPT[None]).long()).logits.numpy()
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-4)
    assert _greedy_ours(params, cfg, PROMPT, 8) == _greedy_hf(hf, PROMPT, 8)


def test_llama_q_k_biases_are_unpermuted_like_the_weights(tmp_path: Path) -> None:
    """A llama GGUF with attention biases (as llama.cpp's converter writes one: q/k biases permuted with their
    rows) gives the logits of the transformers model it was written from. transformers' own GGUF reader drops
    llama biases, so the reference is the source model itself (F32: nothing lost in the file)."""
    hf = _hf_model("llama", seed=6, attention_bias=True)
    path = write_gguf(hf, tmp_path / "bias.gguf", Q.F32)
    cfg = checkpoint.source_config(path)
    assert isinstance(cfg, LlamaConfig) and cfg.qkv_bias and cfg.o_bias
    params = checkpoint.load_gguf_params(path, cfg)
    ours, _ = steps.prefill(params, cfg, jnp.asarray(PROMPT[None]), jnp.asarray([len(PROMPT)], jnp.int32),
                            all_logits=True)  # fmt: skip
    with torch.inference_mode():
        ref = hf(torch.from_numpy(PROMPT[None]).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-4)
    assert _greedy_ours(params, cfg, PROMPT, 6) == _greedy_hf(hf, PROMPT, 6)


def test_every_end_of_generation_id_is_a_stop_id(tmp_path: Path) -> None:
    """eos, eot (end of turn: Llama 3's <|eot_id|>) and eom (end of message) all end generation, eos first."""
    path = write_gguf(_hf_model("llama", seed=3, layers=1), tmp_path / "ends.gguf", Q.F32,
                      end_ids={"eot_token_id": 4, "eom_token_id": 3})  # fmt: skip
    cfg = checkpoint.source_config(path)
    assert isinstance(cfg, LlamaConfig) and cfg.eos_token_ids == (2, 4, 3) and cfg.eos_token_id == 2


def _write_with(path: Path, **overrides: tuple[Any, Any, Any]) -> Path:
    """A valid llama GGUF whose metadata `key: (value, type, array item type)` entries are then overwritten."""
    original = gguf.GGUFWriter.write_header_to_file

    def write_header(self: Any, *args: Any, **kwargs: Any) -> Any:
        for key, (value, vtype, sub_type) in overrides.items():
            self.kv_data[0][key.replace("__", ".")] = gguf.GGUFValue(value=value, type=vtype, sub_type=sub_type)
        return original(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = write_header
    try:
        return write_gguf(_hf_model("llama", seed=3, layers=1), path, Q.F32)
    finally:
        gguf.GGUFWriter.write_header_to_file = original


U32, ARRAY = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.ARRAY
MALFORMED = {  # file name: (metadata overrides, what the error says)
    "zero-heads": ({"llama__attention__head_count": (0, U32, None)}, "head_count is 0"),
    "zero-kv-heads": ({"llama__attention__head_count_kv": (0, U32, None)}, "head_count_kv is 0"),
    "kv-heads-not-dividing": ({"llama__attention__head_count_kv": (3, U32, None)}, "3 kv heads do not divide 4"),
    "alignment-array": ({"general__alignment": ([32, 32], ARRAY, U32)}, "general.alignment is [32, 32]"),
    "bos-out-of-range": ({"tokenizer__ggml__bos_token_id": (99999, U32, None)}, "bos_token_id 99999 is not a token"),
    "eot-out-of-range": ({"tokenizer__ggml__eot_token_id": (272, U32, None)}, "eot_token_id 272 is not a token"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_file_is_one_clear_error(case: str, tmp_path: Path) -> None:
    """Once: ZeroDivisionError, TypeError, or (a BOS past the vocabulary) a server without its tokenizer."""
    overrides, why = MALFORMED[case]
    path = _write_with(tmp_path / f"{case}.gguf", **overrides)
    with pytest.raises(CheckpointError, match=re.escape(why)) as e:
        checkpoint.source_config(path)
    assert str(path) in str(e.value)


def test_serve_ends_on_a_malformed_file_with_one_line(tmp_path: Path) -> None:
    path = _write_with(tmp_path / "zero-heads.gguf", llama__attention__head_count=(0, U32, None))
    cmd = [sys.executable, "-m", "jaxserve", "serve", "--model", str(path), "--grpc-port", "0", "--http-port", "0",
           "--no-warmup", "--compile-cache", "off"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: {path}: llama.attention.head_count is 0" in proc.stderr


def test_k_quant_tensors_dequantize_like_transformers(tmp_path: Path) -> None:
    """Q4_K, Q5_K and Q6_K ffn_down weights (hand-built blocks: the gguf package cannot quantize them)."""
    path = write_gguf(
        _hf_model("llama", seed=4, layers=3), tmp_path / "k.gguf", Q.Q8_0, k_quants=(Q.Q4_K, Q.Q5_K, Q.Q6_K)
    )
    assert {t for n, t in ((n, t.type_name) for n, t in checkpoint.gguf.open_gguf(path).tensors.items())
            if "ffn_down" in n} == {"Q4_K", "Q5_K", "Q6_K"}  # fmt: skip
    cfg = checkpoint.load_gguf_config(path)
    params = checkpoint.load_gguf_params(path, cfg)
    hf = _hf_from_gguf(path)
    for i in range(3):
        ref = hf.model.layers[i].mlp.down_proj.weight.detach().numpy()
        assert np.abs(ref).max() > 0.05
        np.testing.assert_allclose(np.asarray(params["layers"]["down_proj"]["kernel"][i]).T, ref, atol=1e-6)
    with torch.inference_mode():
        ref_logits = hf(torch.from_numpy(PROMPT[None]).long()).logits.numpy()
    ours, _ = steps.prefill(params, cfg, jnp.asarray(PROMPT[None]), jnp.asarray([len(PROMPT)]), all_logits=True)
    np.testing.assert_allclose(np.asarray(ours), ref_logits, atol=2e-4)


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(_hf_model("llama", seed=5), tmp_path_factory.mktemp("q8") / "model.gguf", Q.Q8_0)


@pytest.mark.parametrize("quantization", ["dequantized", None])
def test_tp2_loading_gives_the_same_logits(llama_q8: Path, quantization: str | None) -> None:
    """Dequantized at load (each device dequantizes its rows) or served as stored (each device holds its output
    rows' values and scales)."""
    cfg = checkpoint.load_gguf_config(llama_q8)
    params = checkpoint.load_gguf_params(llama_q8, cfg)
    model = ShardedLlama.load(llama_q8.parent, tp=2, pp=1, devices=jax.devices()[:2], quantization=quantization)
    if quantization is None:
        q = model.run_params[0]["layers"][0]["q_proj"]["kernel"]
        assert isinstance(q, QuantizedWeight) and q.scheme == "q8_0"
        assert q.values.addressable_shards[0].data.shape == (cfg.q_dim // 2, cfg.hidden_size)
        assert q.scales.addressable_shards[0].data.shape == (cfg.q_dim // 2, cfg.hidden_size // 32)
    else:
        q = model.stage_params[0]["layers"]["q_proj"]["kernel"]  # the directory form
        assert q.addressable_shards[0].data.shape == (cfg.num_layers, cfg.hidden_size, cfg.q_dim // 2)
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, cfg.vocab_size, (2, 10)).astype(np.int32)
    lengths = np.array([10, 6], np.int32)
    ref, _ = steps.prefill(params, cfg, tokens, lengths)
    got, _ = model.prefill(tokens, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)


def test_tokenizer_and_chat_template_come_from_the_file(llama_q8: Path) -> None:
    ours = checkpoint.load_tokenizer(llama_q8)
    assert ours is not None
    ref = transformers.AutoTokenizer.from_pretrained(str(llama_q8.parent), gguf_file=llama_q8.name)
    for text in ["the cat sat on the mat", "  whether it rains, or not!", "<|im_start|>user\nhi<|im_end|>", "né 42"]:
        assert ours.encode(text).ids == ref(text)["input_ids"], text
    assert ours.encode("the").ids[0] == 1  # add_bos_token: the BOS goes first
    assert ours.decode(ours.encode("the weather").ids, skip_special_tokens=True) == "the weather"
    template = checkpoint.load_chat_template(llama_q8)
    assert template is not None and template.template == CHAT_TEMPLATE
    assert (template.bos_token, template.eos_token) == ("<s>", "</s>") and "<|im_end|>" in template.special_tokens


def test_a_chat_prompt_gets_one_bos_as_transformers_gives_it(tmp_path: Path) -> None:
    """A Llama-3-style template writes `{{ bos_token }}` and the file's tokenizer adds BOS too
    (`add_bos_token`): the prompt the server sends has one BOS, as `apply_chat_template(tokenize=True)`."""
    import asyncio
    import json

    from serving_helpers import fake_controller

    from jaxserve.serving.frontend import Frontend
    from jaxserve.serving.openai_protocol import ChatCompletionRequest, chat_job

    template = "{{ bos_token }}" + CHAT_TEMPLATE
    path = _write_with(tmp_path / "bos.gguf", tokenizer__chat_template=(template, gguf.GGUFValueType.STRING, None))
    messages = [{"role": "user", "content": "the cat sat"}]
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    expected = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    controller = fake_controller(tokenizer=checkpoint.load_tokenizer(path))
    controller.chat_template = checkpoint.load_chat_template(path)
    try:
        frontend = Frontend(controller)
        (params,) = chat_job(
            ChatCompletionRequest.model_validate_json(json.dumps({"messages": messages})), frontend.chat_template
        ).prompts
        ids = list(asyncio.run(frontend.prepare(params)).request.prompt_token_ids)
    finally:
        controller.shutdown(drain_timeout_s=0)
    assert ids == expected and ids.count(1) == 1 and ids[0] == 1


# ------------------------------------------------------------------------------------------
# Bad files: one clear error each, before anything is placed
# ------------------------------------------------------------------------------------------


def _load(path: Path) -> None:
    ShardedLlama.load(path, tp=1, pp=1, devices=jax.devices()[:1])


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    path = write_gguf(_hf_model("llama", seed=6), tmp_path / "m.gguf", arch="falcon")
    with pytest.raises(UnsupportedModelError, match="architecture 'falcon'"):
        _load(path)


def test_unsupported_quant_type_is_refused_naming_it(tmp_path: Path) -> None:
    path = write_gguf(_hf_model("llama", seed=6), tmp_path / "m.gguf", Q.Q5_0)
    with pytest.raises(UnsupportedModelError, match="Q5_0"):
        _load(path)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = write_gguf(_hf_model("llama", seed=6), tmp_path / "m.gguf", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(path)


def test_shape_disagreeing_with_config_is_named(tmp_path: Path) -> None:
    path = write_gguf(_hf_model("llama", seed=6), tmp_path / "m.gguf", metadata={"feed_forward_length": 128})
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight has shape \(256, 64\), expected \(128, 64\)"):
        _load(path)


def test_unknown_tensor_and_llama3_rope_factors_are_refused(tmp_path: Path) -> None:
    hf = _hf_model("llama", seed=6)
    odd = write_gguf(hf, tmp_path / "odd.gguf", extra={"blk.0.attn_qkv.weight": (np.zeros((4, 64), np.float32), None)})
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_qkv\.weight"):
        _load(odd)
    rope = write_gguf(hf, tmp_path / "rope.gguf", extra={"rope_freqs.weight": (np.ones(8, np.float32), None)})
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        _load(rope)


@pytest.mark.parametrize("keep", [0.3, 0.999])  # cut inside the metadata, or inside the last tensor's data
def test_truncated_file_is_refused(keep: float, llama_q8: Path, tmp_path: Path) -> None:
    data = llama_q8.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match="GGUF"):
        _load(cut)


def test_directory_sources(llama_q8: Path, tmp_path: Path) -> None:
    two = tmp_path / "two"
    two.mkdir()
    shutil.copy(llama_q8, two / "a.gguf")
    shutil.copy(llama_q8, two / "b.gguf")
    with pytest.raises(CheckpointError, match="2 GGUF files"):
        checkpoint.source_config(two)
    assert checkpoint.source_config(two / "a.gguf").name == "a"
    assert checkpoint.source_config(llama_q8.parent).name == llama_q8.parent.name  # model.gguf: named by its dir


def test_rope_scaling_keys_map_to_the_config(tmp_path: Path) -> None:
    meta = {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}
    cfg = checkpoint.load_gguf_config(write_gguf(_hf_model("llama", seed=6), tmp_path / "m.gguf", metadata=meta))
    assert cfg.rope_scaling is not None and (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 4.0)
    yarn = write_gguf(_hf_model("llama", seed=6), tmp_path / "y.gguf", metadata={"rope.scaling.type": "yarn"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        checkpoint.load_gguf_config(yarn)


# ------------------------------------------------------------------------------------------
# Reading: our header parser and dequantizer against the gguf package's, the per-process memo
# ------------------------------------------------------------------------------------------


def _reference_metadata(path: Path) -> dict[str, Any]:
    """The file's metadata as `gguf.GGUFReader` (an independent reader) parses it."""
    reader = gguf.GGUFReader(path, "r")
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        types = list(field.types)
        if types[0] == gguf.GGUFValueType.ARRAY and types[-1] == gguf.GGUFValueType.STRING:
            out[name] = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        elif types[0] == gguf.GGUFValueType.ARRAY:
            out[name] = [field.parts[i].tolist()[0] for i in field.data]
        elif types[0] == gguf.GGUFValueType.STRING:
            out[name] = bytes(field.parts[field.data[0]]).decode("utf-8")
        else:
            out[name] = field.parts[field.data[0]].tolist()[0]
    return out


def test_header_parser_reads_what_the_gguf_package_reads(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)  # not the default 32: the data section must start where the file says
    for add, key, value in [
        (w.add_uint8, "k.u8", 200), (w.add_int8, "k.i8", -100), (w.add_uint16, "k.u16", 60000),
        (w.add_int16, "k.i16", -30000), (w.add_uint32, "k.u32", 4_000_000_000), (w.add_int32, "k.i32", -7),
        (w.add_float32, "k.f32", 0.25), (w.add_uint64, "k.u64", 2**60), (w.add_int64, "k.i64", -(2**60)),
        (w.add_float64, "k.f64", 1e-300), (w.add_bool, "k.bool", True), (w.add_string, "k.str", "né ünïcode"),
        (w.add_array, "k.strs", ["a", "", "Ġthe", "<|im_end|>"]), (w.add_array, "k.ints", [3, 1, 4, 1, 5]),
        (w.add_array, "k.floats", [0.5, -2.0]), (w.add_array, "k.empty", []),
    ]:  # fmt: skip
        add(key, value)  # type: ignore[operator]
    rng = np.random.default_rng(0)
    w.add_tensor("a", rng.normal(size=(3, 64)).astype(np.float32))
    w.add_tensor("b", gguf.quants.quantize(rng.normal(size=(5, 96)).astype(np.float32), Q.Q4_1), raw_dtype=Q.Q4_1)
    w.add_tensor("c", rng.normal(size=7).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ours = checkpoint.gguf.open_gguf(path)
    assert dict(ours.metadata) == _reference_metadata(path)
    assert ours.metadata["k.u64"] == 2**60 and ours.metadata["k.str"] == "né ünïcode"
    ref = {t.name: t for t in gguf.GGUFReader(path, "r").tensors}
    assert set(ours.tensors) == set(ref) == {"a", "b", "c"}
    for name, t in ours.tensors.items():
        r = ref[name]
        assert (t.shape, t.type_name, t.data_offset, t.n_bytes) == (
            tuple(r.shape.tolist()), r.tensor_type.name, int(r.data_offset), int(r.n_bytes))  # fmt: skip
        assert t.data.tobytes() == np.asarray(r.data).tobytes()
    assert ours.tensors["b"].data.shape == (5, 96 // 32 * 20)  # [rows, bytes per row]


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)  # fmt: skip
def test_dequantize_gives_the_gguf_packages_bits(qtype: Any) -> None:
    rows, cols = 6, 512
    rng = np.random.default_rng(int(qtype))
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        raw = _k_quant_blocks(qtype, rows, cols, seed=1)
    else:
        data = rng.normal(scale=3.0, size=(rows, cols)).astype(np.float32)
        data[0, :32] = -(data[0, :32] ** 2)  # one all-negative block (a negative scale / minimum)
        if qtype in (Q.F32, Q.F16):
            data = data.astype(np.float32 if qtype == Q.F32 else np.float16)
        else:
            data = gguf.quants.quantize(data, qtype)
        raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1)
    for pick in (slice(None), np.array([4, 1, 5])):  # all rows; a subset out of order (a device's q/k rows)
        ref = np.asarray(gguf.quants.dequantize(raw[pick], qtype), np.float32).reshape(-1, cols)
        got = checkpoint.gguf.dequantize(raw[pick], qtype.name, cols)
        assert got.dtype == np.float32 and got.shape == ref.shape
        assert got.tobytes() == ref.tobytes()
        assert np.abs(got).max() > 0


def test_the_parsed_file_is_kept_until_the_file_changes(tmp_path: Path) -> None:
    hf = _hf_model("llama", seed=6)
    path = write_gguf(hf, tmp_path / "m.gguf", Q.Q8_0)
    first = checkpoint.gguf.open_gguf(path)
    assert checkpoint.gguf.open_gguf(path) is first  # config, weights, tokenizer: one parse
    before = checkpoint.load_gguf_params(path)
    # a new file moved over the old one (as `jaxserve pull` installs it): other weights, a longer context
    new = write_gguf(_hf_model("llama", seed=7), tmp_path / "new.gguf", Q.Q8_0, metadata={"context_length": 512})
    new.replace(path)
    assert checkpoint.gguf.open_gguf(path) is not first
    assert checkpoint.load_gguf_config(path).max_position_embeddings == 512
    after = checkpoint.load_gguf_params(path)
    assert not np.array_equal(after["embed_tokens"], before["embed_tokens"])
    # rewritten in place with a different length
    write_gguf(hf, path, Q.Q4_0)
    assert checkpoint.gguf.open_gguf(path).tensors["blk.0.ffn_up.weight"].type_name == "Q4_0"


@pytest.mark.parametrize("where", ["kv_count", "key_length"])
def test_absurd_counts_are_refused_at_once(where: str, llama_q8: Path, tmp_path: Path) -> None:
    """A corrupt count or length is a CheckpointError, not a huge allocation or a long loop."""
    data = bytearray(llama_q8.read_bytes())
    offset = 16 if where == "kv_count" else 24  # magic, version, tensor count | kv count | first key's length
    data[offset : offset + 8] = (2**62).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="truncated GGUF file"):
        checkpoint.source_config(bad)
