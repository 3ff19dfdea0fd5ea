"""GGUF checkpoints (llama.cpp's single-file format): config, tensors and tokenizer of a Llama / Qwen2 model.

A GGUF file carries its config as metadata (`llama.embedding_length`, ...), its tokenizer as metadata
(`tokenizer.ggml.tokens`, `.merges`, `.token_type`, ...) and its tensors under llama.cpp names, many
of them block-quantized. We parse the header ourselves (the `gguf` package's reader takes seconds
on a real vocabulary; see `_HeaderParser`), keep the tensor data memory-mapped, dequantize to
float32 at load (`dequantize`: whole-array numpy for the float and 32-element block types, the
`gguf` package for K-quants), and present the tensors under Hugging Face names as `[out, in]`
arrays so the HF reader of `models.checkpoint` places them into any tp x pp layout (each device
dequantizes only the rows it holds). A parsed file is kept per process (`open_gguf`): a start
asks for the same file's config, weights, tokenizer and chat template several times.

Why no on-disk cache of the dequantized weights: SmolLM2-135M's Q4_1 file (98 MB) dequantizes in
~0.3-0.6 s on a loaded 2-core machine; a cache would save that per engine for 540 MB of float32 on
disk. What made a warm start slow was parsing the metadata (2-6 s per parse with the `gguf`
package's reader, ~8 parses per two-instance start).

llama.cpp's converter permutes the rows of the llama architecture's q/k projections (it pairs
rotary dimensions as (2i, 2i+1), Hugging Face as (i, i + head_dim/2)); we undo that per head on
read. Qwen2 files are written unpermuted.

Everything is checked before any tensor is read: architecture, metadata, every tensor's presence,
type and shape, and that the file holds every tensor's bytes. A bad file is one `CheckpointError`
(or `UnsupportedModelError` for a model or quantization we do not implement), naming what.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import struct
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.config import CheckpointError, LlamaConfig, RopeScaling, UnsupportedModelError
from models.stop_ids import GGUF_STOP_KEYS

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
class TensorInfo:
    """One tensor's entry in a GGUF file's tensor table, and its raw bytes (memory-mapped, read-only).

    `shape` is in GGUF order (fastest dimension first); `data` is `[rows, bytes per row]` uint8.
    """

    name: str
    shape: tuple[int, ...]
    type_id: int
    type_name: str  # ggml's name ("Q4_1"); "type<N>" for an id this gguf package does not know
    data_offset: int  # absolute, in the file
    n_bytes: int
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """An opened GGUF file: its metadata as plain Python values and its tensors by GGUF name."""

    path: Path
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo]
    size: int  # bytes

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)


# GGUF metadata value types (the spec's numbering) -> struct format of a scalar, numpy dtype of an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32


class _Truncated(Exception):
    """The header, metadata or tensor table runs past the end of the file (or claims absurd counts)."""


class _HeaderParser:
    """Reads GGUF v2/v3's little-endian header, metadata and tensor table from a memory map.

    Written for speed: a real vocabulary is ~100k strings, and the `gguf` package's reader spends
    seconds building a numpy view per item; here a string is one `struct` read and one decode, a
    numeric array one `np.frombuffer`.
    """

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated(f"needs {n} bytes at offset {self.pos}")

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.need(n)
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:
                itemsize = struct.calcsize(_SCALARS[item_type])
                self.need(count * itemsize)
                out = np.frombuffer(self.buf, _SCALARS[item_type], count, self.pos).tolist()
                self.pos += count * itemsize
                return out
            self.need(count * (8 if item_type == _STRING else 12))  # the least each item can take
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self.pos}")
        return self.scalar(_SCALARS[vtype])


def _parse(path: Path, buf: memoryview) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, [(name, GGUF-order shape, type id, offset relative to the data section)], data section start)."""
    p = _HeaderParser(buf)
    p.need(4)
    if bytes(buf[:4]) != _GGUF_MAGIC:
        raise ValueError(f"no GGUF magic (starts with {bytes(buf[:4])!r})")
    p.pos = 4
    version = p.scalar("<I")
    if version not in (2, 3):
        if version & 0xFFFF == 0:
            raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    num_tensors, num_kv = p.scalar("<Q"), p.scalar("<Q")
    p.need(num_kv * 12 + num_tensors * 24)  # the least each entry can take
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = p.string()
        metadata[key] = p.value(p.scalar("<I"))
    table = []
    for _ in range(num_tensors):
        name = p.string()
        num_dims = p.scalar("<I")
        p.need(8 * num_dims)
        shape = tuple(p.scalar("<Q") for _ in range(num_dims))
        table.append((name, shape, p.scalar("<I"), p.scalar("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 0:
        raise ValueError(f"general.alignment is {alignment!r}: it must be a non-negative integer")
    alignment = alignment or _DEFAULT_ALIGNMENT
    return metadata, table, -(-p.pos // alignment) * alignment


def _type_sizes(type_id: int) -> tuple[str, int, int]:
    """(ggml name, elements per block, bytes per block) of a tensor type id."""
    import gguf

    try:
        qtype = gguf.GGMLQuantizationType(type_id)
    except ValueError:
        return f"type{type_id}", 0, 0
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    return qtype.name, block, nbytes


def _read_file(path: Path) -> GGUFFile:
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{path}: not a readable GGUF file (0 bytes)")
    with path.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)  # stays mapped while the arrays below live
    buf = memoryview(mm)
    try:
        metadata, table, data_start = _parse(path, buf)
    except _Truncated as e:
        raise CheckpointError(f"{path}: truncated GGUF file ({size} bytes): the header {e}") from e
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({size} bytes): {e}") from e
    whole = np.frombuffer(mm, np.uint8)
    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, offset in table:
        type_name, block, block_bytes = _type_sizes(type_id)
        if block == 0:  # without its block size not even the tensor's length is known
            raise UnsupportedModelError(f"{path}: tensor {name} has tensor type id {type_id}, unknown to this reader")
        if not shape or shape[0] % block:
            raise CheckpointError(f"{path}: tensor {name} of type {type_name} has an impossible shape {list(shape)}")
        row_bytes = shape[0] // block * block_bytes
        rows = int(np.prod(shape[1:], dtype=np.int64))
        start = data_start + offset
        if start + rows * row_bytes > size:
            raise CheckpointError(
                f"{path}: truncated GGUF file: tensor {name} ends at byte {start + rows * row_bytes}, the file has {size}"
            )
        data = whole[start : start + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = TensorInfo(name, shape, type_id, type_name, start, rows * row_bytes, data)
    return GGUFFile(path, types.MappingProxyType(metadata), types.MappingProxyType(tensors), size)


@functools.lru_cache(maxsize=4)
def _read_file_cached(path: Path, identity: tuple[int, ...]) -> GGUFFile:
    del identity  # part of the cache key only: a file replaced or rewritten is read afresh
    return _read_file(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse `path`'s header, metadata and tensor table (data stays memory-mapped, read-only).

    A file that is not GGUF, or is cut short anywhere (header, metadata, any tensor's data), is a
    `CheckpointError` here. A start reads one file several times (config, each engine's weights,
    tokenizer, chat template): the parsed file is kept per process, keyed by its path and identity
    (device, inode, size, mtime, ctime), so a file replaced or rewritten is read afresh.
    """
    path = Path(path).absolute()
    st = path.stat()
    return _read_file_cached(path, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))


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


def _check_heads(f: GGUFFile, hidden: Any, heads: Any, kv_heads: Any) -> None:
    """Head counts a model can have: positive, kv heads dividing heads (else a CheckpointError naming them)."""
    counts = {"embedding_length": hidden, "attention.head_count": heads, "attention.head_count_kv": kv_heads}
    for key, value in counts.items():
        if not isinstance(value, int) or value <= 0:
            raise CheckpointError(f"{f.path}: {f.architecture}.{key} is {value!r}: it must be a positive integer")
    if heads % kv_heads:
        raise CheckpointError(f"{f.path}: {kv_heads} kv heads do not divide {heads} attention heads")


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
    _check_heads(f, hidden, heads, kv_heads)  # before any division by them
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
        if value is None:
            return None
        if not isinstance(value, int) or not 0 <= value < vocab:  # the tokenizer would index past its list
            raise CheckpointError(f"{f.path}: tokenizer.ggml.{key} {value!r} is not a token id of its {vocab} tokens")
        return value

    # Every end of generation the file declares (`models.stop_ids`): EOS, end of turn (chat models that
    # mark it apart from EOS, e.g. Llama 3's <|eot_id|>) and end of message (tool calls).
    ends = (token_id(key) for key in GGUF_STOP_KEYS)
    eos_ids = tuple(dict.fromkeys(i for i in ends if i is not None))
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
        if isinstance(e, (UnsupportedModelError, CheckpointError)):
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


def dequantize(raw: np.ndarray, type_name: str, num_cols: int) -> np.ndarray:
    """Rows of a GGUF tensor's raw bytes (`[rows, bytes per row]` uint8) as float32 `[rows, num_cols]`.

    F32/F16/BF16 and the 32-element block types Q8_0, Q4_0, Q4_1 are done here in whole-array numpy
    (one pass over all rows, no per-group Python loop), with the same float32 operations in the same
    order as `gguf.quants` (so the same bits; `tests/test_gguf.py` checks it). K-quants go to
    `gguf.quants`.
    """
    rows = raw.shape[0]
    raw = np.ascontiguousarray(raw)
    if type_name == "F32":
        return raw.view(np.float32).reshape(rows, num_cols)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32).reshape(rows, num_cols)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, num_cols)
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        blocks = raw.reshape(rows, num_cols // 32, -1)  # [rows, blocks, bytes per block]
        scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)  # [rows, blocks, 1]
        if type_name == "Q8_0":
            values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.float32)  # [rows, blocks, 32]
        else:
            packed = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]  # [rows, blocks, 16]
            # element i < 16 is byte i's low nibble, element 16 + i its high nibble
            nibbles = np.concatenate([packed & np.uint8(0x0F), packed >> np.uint8(4)], axis=-1)  # [rows, blocks, 32]
            if type_name == "Q4_0":
                nibbles = nibbles.view(np.int8) - np.int8(8)
            values = nibbles.astype(np.float32)
        np.multiply(values, scale, out=values)  # in place: the float32 output is the one big array made
        if type_name == "Q4_1":
            np.add(values, np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).astype(np.float32), out=values)
        return values.reshape(rows, num_cols)
    import gguf

    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return np.asarray(out, np.float32).reshape(rows, num_cols)


class GGUFTensor:
    """One GGUF tensor as a lazily dequantized float32 array in Hugging Face layout (`[out, in]`).

    Indexing reads (and dequantizes) only the rows asked for; `row_map` is the q/k unpermutation.
    """

    def __init__(self, info: TensorInfo, row_map: np.ndarray | None = None):
        self.info = info
        self.shape = tuple(reversed(info.shape))  # GGUF lists the fastest dim first
        self.ndim = len(self.shape)
        self.dtype = np.dtype(np.float32)
        self.row_map = row_map

    def _rows(self, rows: Any) -> np.ndarray:
        if self.ndim == 1:  # a bias: llama.cpp permutes q/k biases as it permutes their weights' rows
            vector = dequantize(self.info.data, self.info.type_name, self.shape[0])[0]
            return (vector if self.row_map is None else vector[self.row_map])[rows]
        src = np.arange(self.shape[0])[rows]
        if self.row_map is not None:
            src = self.row_map[src]
        return dequantize(self.info.data[src], self.info.type_name, self.shape[-1])  # [len(rows), in]

    def __getitem__(self, index: Any) -> np.ndarray:
        if not isinstance(index, tuple):
            index = (index,)
        index = index + (slice(None),) * (self.ndim - len(index))
        rows = self._rows(index[0])
        return rows if self.ndim == 1 else rows[:, index[1]]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self[(slice(None),) * self.ndim]
        return out if dtype is None else out.astype(dtype, copy=False)


def hf_tensors(f: GGUFFile, cfg: LlamaConfig) -> dict[str, GGUFTensor]:
    """Every tensor of `f` under its Hugging Face name, lazily dequantized; q/k rows unpermuted for llama.

    Raises `UnsupportedModelError` for a tensor type we do not dequantize and `CheckpointError` for
    a tensor we do not know (it would be silently dropped otherwise). Missing tensors and wrong
    shapes are left to `models.checkpoint.HFReader`, which checks every expected name.
    """
    unsupported, unknown = [], []
    out: dict[str, GGUFTensor] = {}
    permuted = f.architecture in _PERMUTED_ARCHITECTURES
    for name, t in f.tensors.items():
        if t.type_name not in SUPPORTED_TYPES:
            unsupported.append(f"{name} is {t.type_name}")
            continue
        target = hf_name(name)
        if target is None:
            unknown.append(name)
            continue
        row_map = None
        if permuted and name.endswith((".attn_q.weight", ".attn_q.bias", ".attn_k.weight", ".attn_k.bias")):
            heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
            rows = t.shape[-1]
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
