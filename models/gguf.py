"""GGUF checkpoints (llama.cpp's single-file format): config, tensors and tokenizer of a Llama / Qwen2 model.

A GGUF file carries its config as metadata (`llama.embedding_length`, ...), its tokenizer as metadata
(`tokenizer.ggml.tokens`, `.merges`, `.token_type`, ...) and its tensors under llama.cpp names, many
of them block-quantized. We read it with the `gguf` package (memory-mapped), dequantize to float32
at load, and present the tensors under Hugging Face names as `[out, in]` arrays so the HF reader of
`models.checkpoint` places them into any tp x pp layout (each device dequantizes only the rows it
holds).

llama.cpp's converter permutes the rows of the llama architecture's q/k projections (it pairs
rotary dimensions as (2i, 2i+1), Hugging Face as (i, i + head_dim/2)); we undo that per head on
read. Qwen2 files are written unpermuted.

Everything is checked before any tensor is read: architecture, metadata, every tensor's presence,
type and shape, and that the file holds every tensor's bytes. A bad file is one `CheckpointError`
(or `UnsupportedModelError` for a model or quantization we do not implement), naming what.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.config import CheckpointError, LlamaConfig, RopeScaling, UnsupportedModelError

if TYPE_CHECKING:
    import tokenizers

ARCHITECTURES = ("llama", "qwen2")
# The tensor types we dequantize at load (by their ggml names).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# llama.cpp's converter permutes q/k rows for these architectures only.
_PERMUTED_ARCHITECTURES = ("llama",)


# ------------------------------------------------------------------------------------------
# The file
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its metadata as plain Python values and its tensors by GGUF name."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, Any]  # name -> gguf.ReaderTensor

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


def _field_value(field: Any) -> Any:
    """A metadata field as a Python value (str, int, float, bool, or a list of them)."""
    import gguf

    types = list(field.types)
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        item_type = types[-1]
        if item_type == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s header, metadata and tensor table (data stays memory-mapped).

    A file that is not GGUF, or is cut short anywhere (header, metadata, any tensor's data), is a
    `CheckpointError` here.
    """
    import gguf

    path = Path(path)
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as e:  # the reader raises ValueError/IndexError/... on short or foreign files
        raise CheckpointError(f"{path}: not a readable GGUF file ({size} bytes): {type(e).__name__}: {e}") from e
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        metadata[name] = _field_value(field)
    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {t.name} ends at byte {end}, the file has {size}"
            )
        tensors[t.name] = t
    return GGUFFile(path, metadata, tensors)


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


def _required(f: GGUFFile, key: str) -> Any:
    value = f.arch_key(key)
    if value is None:
        raise CheckpointError(f"{f.path}: GGUF metadata has no {f.architecture}.{key}")
    if isinstance(value, list):
        raise UnsupportedModelError(f"{f.path}: {f.architecture}.{key} varies per layer ({value[:4]}...)")
    return value


def gguf_config(f: GGUFFile, name: str | None = None) -> LlamaConfig:
    """The `LlamaConfig` a GGUF file's metadata and tensor table describe (llama or qwen2 architecture)."""
    arch = f.architecture
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{f.path}: GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    hidden = int(_required(f, "embedding_length"))
    heads = int(_required(f, "attention.head_count"))
    kv_heads = f.arch_key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError(f"{f.path}: {arch}.attention.head_count_kv varies per layer")
    head_dim = int(f.arch_key("attention.key_length", hidden // heads))
    problems = []
    value_dim = int(f.arch_key("attention.value_length", head_dim))
    if value_dim != head_dim:
        problems.append(f"attention.value_length {value_dim} != key_length {head_dim}")
    rotary = int(f.arch_key("rope.dimension_count", head_dim))
    if rotary != head_dim:
        problems.append(f"rope.dimension_count {rotary} != head dim {head_dim} (partial RoPE)")
    if "rope_freqs.weight" in f.tensors:
        problems.append("a rope_freqs tensor (per-frequency RoPE factors, as llama3 RoPE is written)")
    if f.arch_key("attention.sliding_window") is not None:
        problems.append("attention.sliding_window (sliding-window attention)")
    rope_scaling = None
    scaling_type = str(f.arch_key("rope.scaling.type", "none"))
    if scaling_type == "linear":
        rope_scaling = RopeScaling("linear", float(f.arch_key("rope.scaling.factor", 1.0)))
    elif scaling_type != "none":
        problems.append(f"rope.scaling.type {scaling_type!r} (supported: none, linear)")
    if problems:
        raise UnsupportedModelError(f"{f.path}: GGUF {arch} model not supported: " + "; ".join(problems))
    tokens = f.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab = len(tokens)
    elif f.arch_key("vocab_size") is not None:
        vocab = int(f.arch_key("vocab_size"))
    elif "token_embd.weight" in f.tensors:
        vocab = int(f.tensors["token_embd.weight"].shape[1])
    else:
        raise CheckpointError(f"{f.path}: GGUF file has no token list, vocab_size, or token_embd.weight")

    def token_id(key: str) -> int | None:
        value = f.get(f"tokenizer.ggml.{key}")
        return None if value is None else int(value)

    eos = token_id("eos_token_id")
    eot = token_id("eot_token_id")  # end of turn, for chat models that mark it apart from EOS
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    try:
        return LlamaConfig(
            name=name or str(f.get("general.name") or f.path.stem),
            hidden_size=hidden,
            intermediate_size=int(_required(f, "feed_forward_length")),
            num_layers=int(_required(f, "block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            vocab_size=vocab,
            head_dim_=None if head_dim == hidden // heads else head_dim,
            max_position_embeddings=int(f.arch_key("context_length", 4096)),
            rms_norm_eps=float(f.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(f.arch_key("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            qkv_bias="blk.0.attn_q.bias" in f.tensors,
            o_bias="blk.0.attn_output.bias" in f.tensors,
            tie_word_embeddings="output.weight" not in f.tensors,
            family=arch,
            bos_token_id=token_id("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=token_id("padding_token_id"),
        )
    except ValueError as e:
        if isinstance(e, UnsupportedModelError):
            raise
        raise CheckpointError(f"{f.path}: inconsistent GGUF metadata: {e}") from e


# ------------------------------------------------------------------------------------------
# Tensors under Hugging Face names
# ------------------------------------------------------------------------------------------

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}  # fmt: skip
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name (None for a name we do not map)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def _unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """For each Hugging Face row of a q/k projection, the GGUF row that holds it.

    llama.cpp writes head h's rows as (h, pair j, half i) -> h*hd + 2j + i, where Hugging Face has
    (h, half i, pair j) -> h*hd + i*hd/2 + j.
    """
    head_dim = num_rows // num_heads
    h, i, j = np.meshgrid(np.arange(num_heads), np.arange(2), np.arange(head_dim // 2), indexing="ij")
    return (h * head_dim + 2 * j + i).reshape(-1)


class GGUFTensor:
    """One GGUF tensor as a lazily dequantized float32 array in Hugging Face layout (`[out, in]`).

    Indexing reads (and dequantizes) only the rows asked for; `row_map` is the q/k unpermutation.
    """

    def __init__(self, tensor: Any, row_map: np.ndarray | None = None):
        self.tensor = tensor
        self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dim first
        self.ndim = len(self.shape)
        self.dtype = np.dtype(np.float32)
        self.row_map = row_map

    def _rows(self, rows: Any) -> np.ndarray:
        import gguf

        raw = self.tensor.data
        if self.ndim == 1:
            return np.asarray(gguf.quants.dequantize(np.asarray(raw), self.tensor.tensor_type), np.float32)[rows]
        src = np.arange(self.shape[0])[rows]
        if self.row_map is not None:
            src = self.row_map[src]
        out = gguf.quants.dequantize(np.asarray(raw[src]), self.tensor.tensor_type)  # [len(rows), in]
        return np.asarray(out, np.float32).reshape(len(src), self.shape[1])

    def __getitem__(self, index: Any) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        rows = self._rows(index[0])
        return rows if self.ndim == 1 else rows[:, index[1]]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[(slice(None),) * self.ndim]
        return out if dtype is None else out.astype(dtype)


def hf_tensors(f: GGUFFile, cfg: LlamaConfig) -> dict[str, GGUFTensor]:
    """Every tensor of `f` under its Hugging Face name, lazily dequantized; q/k rows unpermuted for llama.

    Raises `UnsupportedModelError` for a tensor type we do not dequantize and `CheckpointError` for
    a tensor we do not know (it would be silently dropped otherwise). Missing tensors and wrong
    shapes are left to `models.checkpoint.HFReader`, which checks every expected name.
    """
    import gguf

    unsupported, unknown = [], []
    out: dict[str, GGUFTensor] = {}
    permuted = f.architecture in _PERMUTED_ARCHITECTURES
    for name, t in f.tensors.items():
        type_name = gguf.GGMLQuantizationType(t.tensor_type).name
        if type_name not in SUPPORTED_TYPES:
            unsupported.append(f"{name} is {type_name}")
            continue
        target = hf_name(name)
        if target is None:
            unknown.append(name)
            continue
        row_map = None
        if permuted and name.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            rows = int(t.shape.tolist()[-1]) if len(t.shape) > 1 else int(t.shape[0])
            if rows % (2 * heads) == 0:  # else a wrong shape: HFReader names it
                row_map = _unpermute_rows(rows, heads)
        out[target] = GGUFTensor(t, row_map)
    if unsupported:
        raise UnsupportedModelError(
            f"{f.path}: GGUF tensor type not supported ({', '.join(unsupported[:4])}"
            f"{', ...' if len(unsupported) > 4 else ''}); supported: {', '.join(SUPPORTED_TYPES)}"
        )
    if unknown:
        raise CheckpointError(f"{f.path}: GGUF tensors this loader does not know: {', '.join(unknown[:8])}")
    return out


# ------------------------------------------------------------------------------------------
# Finding a GGUF source
# ------------------------------------------------------------------------------------------


def find_gguf(source: str | Path) -> Path | None:
    """The GGUF file `source` names: a `.gguf` file, or a directory holding exactly one (and no safetensors).

    None when `source` is not a GGUF source; a `CheckpointError` for a directory with several.
    """
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")) or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise CheckpointError(
            f"{path}: holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); name one of them"
        )
    return found[0] if found else None


# ------------------------------------------------------------------------------------------
# Tokenizer and chat template
# ------------------------------------------------------------------------------------------

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (llama.cpp's names for the regexes it uses).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
_GPT2_STYLE = ("default", "gpt2", "smollm")  # GPT-2's own split; smollm also splits digits one by one


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet byte-level BPE vocabularies are spelled in)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def gguf_tokenizer(f: GGUFFile) -> tokenizers.Tokenizer:
    """The byte-level BPE tokenizer (`tokenizer.ggml.model` "gpt2") a GGUF file describes.

    Control tokens (`<|im_start|>`, ...) become special tokens, user-defined ones plain added tokens;
    a BOS goes in front when `tokenizer.ggml.add_bos_token` says so.
    """
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModelError(
            f"{f.path}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', byte-level BPE)"
        )
    tokens: list[str] = list(f.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(f.get("tokenizer.ggml.merges") or [])
    if not tokens or not merges:
        raise CheckpointError(f"{f.path}: GGUF tokenizer has no token list or no merges")
    pre = str(f.get("tokenizer.ggml.pre", "default"))
    if pre not in _SPLITS and pre not in _GPT2_STYLE:
        raise UnsupportedModelError(
            f"{f.path}: GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_GPT2_STYLE + tuple(_SPLITS))})"
        )
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):  # a token spelled outside the byte alphabet is respelled through its bytes
        vocab.setdefault(text if set(text) <= alphabet else "".join(spelling[b] for b in text.encode("utf-8")), i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = tokenizers.Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))  # type: ignore[arg-type]
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )  # fmt: skip
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    types = list(f.get("tokenizer.ggml.token_type") or [])
    control = [t for t, ty in zip(tokens, types, strict=False) if ty == _TOKEN_CONTROL and set(t) <= alphabet]
    user = [t for t, ty in zip(tokens, types, strict=False) if ty == _TOKEN_USER_DEFINED and t in vocab]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    bos = f.get("tokenizer.ggml.bos_token_id")
    if f.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        bos_text = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B", special_tokens=[(bos_text, int(bos))]
        )
    return tok


def special_token_texts(f: GGUFFile) -> list[str]:
    """The texts of a GGUF vocabulary's control tokens (what chat content must not spell)."""
    types = list(f.get("tokenizer.ggml.token_type") or [])
    tokens = list(f.get("tokenizer.ggml.tokens") or [])
    return [t for t, ty in zip(tokens, types, strict=False) if ty == _TOKEN_CONTROL and t]


def token_text(f: GGUFFile, key: str) -> str | None:
    """The text of the token `tokenizer.ggml.{key}` names (e.g. "bos_token_id"), or None."""
    index = f.get(f"tokenizer.ggml.{key}")
    tokens = f.get("tokenizer.ggml.tokens") or []
    return str(tokens[int(index)]) if index is not None and 0 <= int(index) < len(tokens) else None
