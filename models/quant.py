"""Quantized weights as a parameter type: packed integers + per-block scales (and mins), and their matmul.

A `QuantizedWeight` is a linear layer's weight, logical shape `[in, out]` (what `x @ W` multiplies), stored
OUTPUT-MAJOR, the way a GGUF file stores it (one row per output, blocks along the input):

    values  int8  [out, in_pad]        (bits=8)   or  uint8 [out, in_pad // 2] (bits=4, two per byte)
    scales  f16/f32 [out, in_pad // block]
    mins    f16/f32 [out, in_pad // block], or None

    w[i, o] = scales[o, i // block] * q[o, i] + mins[o, i // block]
    (no mins: 8-bit q * scale; 4-bit (q - 8) * scale, llama.cpp's Q4_0)

A 4-bit block's 32 values sit in 16 bytes as GGUF's Q4_0/Q4_1 hold them: byte j's low nibble is element j,
its high nibble element 16 + j (so a SIMD kernel gets 16 consecutive values from each half of a byte vector).
`in_pad` rounds `in` up to whole blocks (and to 32); every form multiplies the padding inputs by zeros of x
(it pads x, or slices the weight), so whatever they hold never counts. Every leaf has the output dimension first, so splitting OUTPUT over a tp axis
(`PartitionSpec("tp", None)` on every leaf: `partition_spec`) keeps each output row's scales and mins on the
device that holds its values; splitting INPUT at block boundaries (`PartitionSpec(None, "tp")`) works when
the tp size divides the number of blocks.

What we serve, and where it comes from (all dequantize to exactly the float32 values `gguf.quants` gives):

    GGUF Q8_0   bits 8, block 32,  f16 scales                    (kept as stored)
    GGUF Q4_0   bits 4, block 32,  f16 scales                    (kept as stored)
    GGUF Q4_1   bits 4, block 32,  f16 scales, f16 mins          (kept as stored)
    GGUF Q4_K   bits 4, block 32,  f32 scales d*sc, f32 mins -dmin*m   (repacked: 6.0 bits/weight, was 4.5)
    GGUF Q5_K   bits 8, block 32,  f32 scales, f32 mins, q in [0, 32)  (repacked: 10 bits/weight, was 5.5)
    GGUF Q6_K   bits 8, block 16,  f32 scales d*sc, q - 32 in [-32, 32) (repacked: 10 bits/weight, was 6.56)
    int8        bits 8, one block per row (per-channel), f32 scales, symmetric  (`quantize_int8`)
    int4        bits 4, group-wise (default 64), f32 scales and mins, asymmetric (`quantize_int4`)

The K-quants' two-level scales (a 6- or 8-bit scale per sub-block times an f16 per 256) multiply out exactly
in float32 (at most 11 + 8 + 6 significant bits), so the repacking loses nothing; it spends bytes, which a
kernel that reads the two-level form would save (not written yet: the SmolLM2 file is Q4_1).

The matmul `x [..., in] f32 @ W -> [..., out] f32` has three forms (`quant_matmul(impl=...)`):
* "xla": dequantize in the graph and `dot_general`; the fallback everywhere. XLA:CPU does NOT fuse the
  dequantization into the dot: it writes the float32 weight and the dot reads it back, so this form reads
  more bytes than the fp32 dense matmul (see docs/performance.md, "Quantized weights: kernels").
* "cpu_kernel": `models/kernels/quant_matmul_cpu.cc`, an XLA FFI custom call that dequantizes in registers and
  reads each weight byte once per call for the whole batch (built on first use by `models.kernels.cpu`).
* "pallas": a Pallas kernel over tiles of output rows for GPU / TPU (tested here with `interpret=True`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels import cpu as cpu_kernel
from models.pytree import pytree_dataclass, static_field

Impl = Literal["auto", "xla", "cpu_kernel", "pallas"]
# The C++ kernel's decode arithmetic (`QuantizedWeight.activations`): "float32" multiplies x as given; "int8"
# quantizes x per 32-block to int8 (d = amax / 127, q = rint(x / d)) and sums integer products (AVX512-VNNI),
# llama.cpp's form: each value of x moves by at most d / 2, so |y - y_f32| <= sum_blocks d_x / 2 * sum |w|.
ACTIVATIONS = ("float32", "int8")
# The GGUF tensor types kept quantized (by ggml's names); any other type is the loader's to dequantize.
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
SCHEMES = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "int8", "int4")
_STEP = 32  # the kernel's unit along the input: in_pad is a multiple of it
# From this many rows of x on, the CPU path dequantizes the weight (C++, once) and lets XLA's float GEMM multiply:
# the product is compute-bound there and the GEMM outruns the kernel's tiles (docs/performance.md).
DEQUANTIZE_ROWS = 64


class QuantFormatError(ValueError):
    """A quantized weight whose parts disagree (shapes, dtypes, block size) or an unknown scheme."""


class UnsupportedQuantizationError(QuantFormatError):
    """A GGUF tensor type we cannot serve quantized (the loader dequantizes it, with a warning naming it)."""


@pytree_dataclass
class QuantizedWeight:
    """A `[in, out]` weight as packed integers + per-block scales (+ mins); see the module docstring."""

    values: Any  # int8 [out, in_pad] (bits 8) | uint8 [out, in_pad // 2] (bits 4)
    scales: Any  # float16 | float32 [out, in_pad // block]
    mins: Any  # like scales, or None
    scheme: str = static_field()  # one of SCHEMES: where it came from
    bits: int = static_field()  # 4 or 8
    block: int = static_field()  # input elements per scale
    shape: tuple[int, int] = static_field()  # logical [in, out]
    # Which matmul form `quant_matmul(impl="auto")` runs for this weight: "auto" picks per backend; a weight
    # split over a tp mesh is marked "xla" (XLA partitions its dot; the C++ custom call it cannot split).
    impl: str = static_field(default="auto")
    # What the C++ kernel multiplies this weight by at decode (batch <= 4, block 32, an AVX512-VNNI CPU):
    # "float32", x as given (exact parity with the dequantized weight), or "int8", x quantized per 32-block
    # like llama.cpp's Q8 (integer dot products; see `ACTIVATIONS`). Elsewhere the float32 form runs.
    activations: str = static_field(default="float32")

    @property
    def in_pad(self) -> int:
        return int(self.values.shape[-1]) * (8 // self.bits)

    @property
    def num_blocks(self) -> int:
        return self.in_pad // self.block

    def nbytes(self) -> int:
        """Bytes a matmul reads: values, scales and mins."""
        leaves = [self.values, self.scales] + ([] if self.mins is None else [self.mins])
        return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)

    def dequantize(self) -> jax.Array:
        """The float32 `[in, out]` weight."""
        return dequantize_rows(self)[:, : self.shape[0]].T

    def take_rows(self, rows: Any) -> QuantizedWeight:
        """The weight restricted to the output rows `rows` (a permutation, a slice, a stage's cut)."""
        mins = None if self.mins is None else self.mins[rows]
        values = self.values[rows]
        return dataclasses.replace(
            self, values=values, scales=self.scales[rows], mins=mins, shape=(self.shape[0], int(values.shape[0]))
        )


def checked(
    values: Any, scales: Any, mins: Any, *, scheme: str, bits: int, block: int, shape: Sequence[int]
) -> QuantizedWeight:
    """A `QuantizedWeight` from its parts, after checking that they agree; one `QuantFormatError` if not."""
    if scheme not in SCHEMES:
        raise QuantFormatError(f"unknown quantization scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    if bits not in (4, 8):
        raise QuantFormatError(f"{scheme}: bits must be 4 or 8, not {bits}")
    if len(shape) != 2 or min(shape) < 1:
        raise QuantFormatError(f"{scheme}: the logical shape must be [in, out] with both >= 1, not {tuple(shape)}")
    n_in, n_out = int(shape[0]), int(shape[1])
    want_values = np.dtype(np.int8 if bits == 8 else np.uint8)
    if np.ndim(values) != 2 or np.dtype(values.dtype) != want_values or values.shape[0] != n_out:
        raise QuantFormatError(
            f"{scheme}: values must be {want_values} [out={n_out}, packed in], not "
            f"{np.dtype(values.dtype)} {tuple(values.shape)}"
        )
    in_pad = int(values.shape[1]) * (8 // bits)
    unit = 16 if bits == 8 else 32
    if block < unit or block % unit or in_pad % block or in_pad % _STEP:
        raise QuantFormatError(
            f"{scheme}: block {block} must be a multiple of {unit} dividing the padded input {in_pad} (a multiple of "
            f"{_STEP})"
        )
    if not n_in <= in_pad < n_in + max(block, _STEP):
        raise QuantFormatError(f"{scheme}: values hold {in_pad} inputs per row; the logical input is {n_in}")
    if scales is None:
        raise QuantFormatError(f"{scheme}: scales are required")
    want_scales = (n_out, in_pad // block)
    for name, part in (("scales", scales), ("mins", mins)):
        if part is None:
            continue
        if tuple(part.shape) != want_scales or np.dtype(part.dtype) not in (np.float16, np.float32):
            raise QuantFormatError(
                f"{scheme}: {name} must be float16 or float32 [out, blocks] = {list(want_scales)} (block {block}), "
                f"not {np.dtype(part.dtype)} {list(part.shape)}"
            )
    if mins is not None and np.dtype(mins.dtype) != np.dtype(scales.dtype):
        raise QuantFormatError(f"{scheme}: scales ({scales.dtype}) and mins ({mins.dtype}) must share a dtype")
    return QuantizedWeight(values, scales, mins, scheme=scheme, bits=bits, block=block, shape=(n_in, n_out))


# ------------------------------------------------------------------------------------------
# Constructors
# ------------------------------------------------------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (`[..., 2]` uint8) as float16 `[...]`."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins per super-block -> ([..., 8], [..., 8]) uint8."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scale = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    low_min = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return scale, low_min


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 values in [0, 16) `[rows, n]` (n a multiple of 32) -> `[rows, n // 2]`: per 32, j | (16 + j) << 4."""
    rows, n = q.shape
    q = q.reshape(rows, n // 32, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << np.uint8(4))).reshape(rows, n // 2)


def from_gguf(raw: np.ndarray, type_name: str, num_cols: int) -> QuantizedWeight:
    """A GGUF tensor's rows (`[rows, bytes per row]` uint8, as `models.gguf.TensorInfo.data` holds them: rows are
    outputs, `num_cols` the input length) as a `QuantizedWeight` of logical shape `[num_cols, rows]`.

    Q8_0 / Q4_0 / Q4_1 are kept as stored (split into values and scales); Q4_K / Q5_K / Q6_K are repacked
    losslessly (see the module docstring). Any other type raises `UnsupportedQuantizationError`.
    """
    if type_name not in GGUF_TYPES:
        raise UnsupportedQuantizationError(
            f"GGUF tensor type {type_name} is not served quantized (kept: {', '.join(GGUF_TYPES)}); dequantize it"
        )
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2:
        raise QuantFormatError(f"{type_name}: raw rows must be [rows, bytes per row], not {raw.shape}")
    rows = raw.shape[0]
    per_block, block_bytes = {
        "Q8_0": (32, 34),
        "Q4_0": (32, 18),
        "Q4_1": (32, 20),
        "Q4_K": (256, 144),
        "Q5_K": (256, 176),
        "Q6_K": (256, 210),
    }[type_name]
    if num_cols % per_block or raw.shape[1] != num_cols // per_block * block_bytes:
        raise QuantFormatError(
            f"{type_name}: {num_cols} columns need a multiple of {per_block} and {num_cols // per_block} blocks of "
            f"{block_bytes} bytes per row; the rows hold {raw.shape[1]} bytes"
        )
    blocks = raw.reshape(rows, num_cols // per_block, block_bytes)  # [rows, blocks, bytes]
    shape = (num_cols, rows)
    if type_name == "Q8_0":
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, num_cols)
        return checked(values, _f16(blocks[..., 0:2]), None, scheme="q8_0", bits=8, block=32, shape=shape)
    if type_name in ("Q4_0", "Q4_1"):
        start = 4 if type_name == "Q4_1" else 2
        values = np.ascontiguousarray(blocks[..., start:]).reshape(rows, num_cols // 2)
        mins = _f16(blocks[..., 2:4]) if type_name == "Q4_1" else None
        return checked(values, _f16(blocks[..., 0:2]), mins, scheme=type_name.lower(), bits=4, block=32, shape=shape)
    if type_name in ("Q4_K", "Q5_K"):
        d = _f16(blocks[..., 0:2]).astype(np.float32)[..., None]  # [rows, sb, 1]
        dmin = _f16(blocks[..., 2:4]).astype(np.float32)[..., None]
        sc, mn = _k_scales(blocks[..., 4:16])  # [rows, sb, 8]
        scales = (d * sc.astype(np.float32)).reshape(rows, -1)  # exact: 11 + 6 significant bits
        mins = -(dmin * mn.astype(np.float32)).reshape(rows, -1)
        # each 32 bytes of qs hold two sub-blocks: low nibbles the first 32 values, high nibbles the next 32
        qs = blocks[..., -128:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & np.uint8(0x0F)).reshape(rows, -1, 8, 32)  # [rows, sb, sub-block, 32]
        if type_name == "Q4_K":
            values = _pack_nibbles(q.reshape(rows, num_cols))
            return checked(values, scales, mins, scheme="q4_k", bits=4, block=32, shape=shape)
        qh = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        q = q | ((qh & np.uint8(1)) << np.uint8(4))  # the fifth bit of sub-block i is bit i of qh
        values = q.reshape(rows, num_cols).view(np.int8)
        return checked(values, scales, mins, scheme="q5_k", bits=8, block=32, shape=shape)
    # Q6_K: ql [128] (low 4 bits), qh [64] (high 2 bits), 16 int8 scales, f16 d; per 128 values: ql 64, qh 32
    ql = blocks[..., 0:128].reshape(rows, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    ql = (ql & np.uint8(0x0F)).reshape(rows, -1, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    qh = (qh & np.uint8(0x03)).reshape(rows, -1, 2, 4, 32)
    values = ((ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)).reshape(rows, num_cols)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)  # [rows, sb, 16]
    scales = (_f16(blocks[..., 208:210]).astype(np.float32)[..., None] * sc).reshape(rows, -1)
    return checked(values, scales, None, scheme="q6_k", bits=8, block=16, shape=shape)


def _padded(w: np.ndarray, multiple: int) -> np.ndarray:
    """`w` [in, out] as float32 [out, in_pad] with zero columns up to a multiple of `multiple`."""
    n_in = w.shape[0]
    rows = np.zeros((w.shape[1], -(-n_in // multiple) * multiple), np.float32)
    rows[:, :n_in] = w.T
    return rows


def quantize_int8(w: Any) -> QuantizedWeight:
    """Per-channel (one scale per output) symmetric int8 of a float `[in, out]` weight: q = round(w / s),
    s = max |w[:, o]| / 127; |w - s q| <= s / 2."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise QuantFormatError(f"int8: a 2-D [in, out] weight expected, not {w.shape}")
    rows = _padded(w, _STEP)  # [out, in_pad]
    scale = np.abs(rows).max(axis=1, keepdims=True) / np.float32(127)  # [out, 1]
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    values = np.clip(np.rint(rows * inv), -127, 127).astype(np.int8)
    return checked(values, scale, None, scheme="int8", bits=8, block=rows.shape[1], shape=w.shape)


def quantize_int4(w: Any, group: int = 64) -> QuantizedWeight:
    """Group-wise asymmetric int4 of a float `[in, out]` weight: per `group` inputs of an output, s = (max - min)
    / 15, m = min, q = round((w - m) / s) in [0, 16); |w - (s q + m)| <= s / 2 (plus float32 rounding)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise QuantFormatError(f"int4: a 2-D [in, out] weight expected, not {w.shape}")
    if group < 32 or group % 32:
        raise QuantFormatError(f"int4: the group size must be a multiple of 32, not {group}")
    rows = _padded(w, group)  # [out, in_pad]
    n_out, in_pad = rows.shape
    g = rows.reshape(n_out, in_pad // group, group)
    # padding columns count as zeros in the last group's range: harmless, and they are never read against data
    lo, hi = g.min(axis=-1), g.max(axis=-1)  # [out, groups]
    scale = (hi - lo) / np.float32(15)
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint((g - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
    values = _pack_nibbles(q.reshape(n_out, in_pad))
    return checked(values, scale, lo, scheme="int4", bits=4, block=group, shape=w.shape)


# ------------------------------------------------------------------------------------------
# Dequantization and the XLA form
# ------------------------------------------------------------------------------------------


def _unpacked(w: QuantizedWeight) -> jax.Array:
    """The integer values as float32 `[out, in_pad]` (4-bit: centred on 8 when the scheme has no mins)."""
    values = jnp.asarray(w.values)
    if w.bits == 8:
        return values.astype(jnp.float32)
    n_out = values.shape[0]
    packed = values.reshape(n_out, -1, 1, 16)  # [out, steps, 1, 16]
    q = jnp.concatenate([packed & 0x0F, packed >> 4], axis=2).reshape(n_out, -1)  # [out, in_pad]
    q = q.astype(jnp.float32)
    return q if w.mins is not None else q - 8.0


def dequantize_rows(w: QuantizedWeight) -> jax.Array:
    """float32 `[out, in_pad]`: w = s q + m per block (the padding columns included)."""
    q = _unpacked(w)
    n_out = q.shape[0]
    q = q.reshape(n_out, w.num_blocks, w.block)
    out = q * jnp.asarray(w.scales).astype(jnp.float32)[..., None]
    if w.mins is not None:
        out = out + jnp.asarray(w.mins).astype(jnp.float32)[..., None]
    return out.reshape(n_out, w.in_pad)


_ROWS = (((1,), (1,)), ((), ()))  # dot_general: contract x's inputs with a row-major weight's (no transpose)


def matmul_xla(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [B, in] f32 @ W -> [B, out] f32, dequantizing in the graph.

    4-bit: the low and the high nibbles are dequantized as two weights (`[out, in_pad / 2]` each, a plain
    elementwise fusion) against x's matching halves of each 32 inputs, and the two products added: putting
    the nibbles back in input order is an interleave XLA:CPU runs ~6x slower than the dequantization itself
    (1.05 ms against 0.18 ms for 768 x 3072, one thread)."""
    if w.bits == 8:
        rows = dequantize_rows(w)[:, : w.shape[0]]  # [out, in]
        return jax.lax.dot_general(x, rows, _ROWS, preferred_element_type=jnp.float32)
    n_out, steps = w.shape[1], w.in_pad // _STEP
    packed = jnp.asarray(w.values).reshape(n_out, steps, 16)
    scale = jnp.repeat(jnp.asarray(w.scales).astype(jnp.float32), w.block // _STEP, axis=1)[
        ..., None
    ]  # [out, steps, 1]
    low, high = (packed & 0x0F).astype(jnp.float32), (packed >> 4).astype(jnp.float32)  # [out, steps, 16]
    if w.mins is None:
        low, high = low - 8.0, high - 8.0
    low, high = low * scale, high * scale
    if w.mins is not None:
        mins = jnp.repeat(jnp.asarray(w.mins).astype(jnp.float32), w.block // _STEP, axis=1)[..., None]
        low, high = low + mins, high + mins
    halves = jnp.pad(x, ((0, 0), (0, w.in_pad - w.shape[0]))).reshape(x.shape[0], steps, 2, 16)  # [B, steps, 2, 16]
    out = jax.lax.dot_general(
        halves[:, :, 0].reshape(x.shape[0], -1), low.reshape(n_out, -1), _ROWS, preferred_element_type=jnp.float32
    )
    return out + jax.lax.dot_general(
        halves[:, :, 1].reshape(x.shape[0], -1), high.reshape(n_out, -1), _ROWS, preferred_element_type=jnp.float32
    )


# ------------------------------------------------------------------------------------------
# The CPU kernel and the Pallas form
# ------------------------------------------------------------------------------------------


def matmul_cpu_kernel(x: jax.Array, w: QuantizedWeight, activations: str | None = None) -> jax.Array:
    """x [B, in] f32 @ W -> [B, out] f32 through the C++ kernel (raises if it is not available here);
    `activations`: "float32" | "int8" (None: the weight's own, `QuantizedWeight.activations`)."""
    target = cpu_kernel.quant_matmul_target()
    if target is None:
        raise RuntimeError(f"the CPU quantized-matmul kernel is unavailable: {cpu_kernel.quant_build_error()}")
    return _kernel_call(target, x, w, activations)


def _kernel_call(target: str, x: jax.Array, w: QuantizedWeight, activations: str | None = None) -> jax.Array:
    """The FFI call of a registered build of the kernel (`target`: the default one, or a test's AVX2 build)."""
    activations = w.activations if activations is None else activations
    if activations not in ACTIVATIONS:
        raise QuantFormatError(f"activations must be one of {ACTIVATIONS}, not {activations!r}")
    # No mins: a one-element placeholder (an FFI buffer cannot be absent); the kernel reads `has_mins`.
    mins = w.mins if w.mins is not None else jnp.zeros((1,), w.scales.dtype)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(
        x.astype(jnp.float32),
        w.values,
        w.scales,
        mins,
        bits=np.int64(w.bits),
        block=np.int64(w.block),
        has_mins=w.mins is not None,
        int8_activations=activations == "int8",
    )


def dequantize_cpu_kernel(w: QuantizedWeight) -> jax.Array:
    """float32 `[out, in_pad]` of `w` through the C++ kernel's dequantizing handler (in registers, at memory
    speed, threaded), the padding columns included; raises if the kernel is unavailable here."""
    target = cpu_kernel.dequantize_target()
    if target is None:
        raise RuntimeError(f"the CPU quantized-matmul kernel is unavailable: {cpu_kernel.quant_build_error()}")
    mins = w.mins if w.mins is not None else jnp.zeros((1,), w.scales.dtype)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((w.shape[1], w.in_pad), jnp.float32))
    return call(  # type: ignore[no-any-return]
        w.values, w.scales, mins, bits=np.int64(w.bits), block=np.int64(w.block), has_mins=w.mins is not None
    )


def matmul_dequantized(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x [B, in] f32 @ W for many rows B (a prefill): the C++ kernel dequantizes W once, XLA's float GEMM
    multiplies (compute-bound there, where the kernel's own tiles are slower; the float weight is a temporary)."""
    rows = dequantize_cpu_kernel(w)  # [out, in_pad]
    x_pad = jnp.pad(x, ((0, 0), (0, w.in_pad - w.shape[0])))  # [B, in_pad]: the padding meets zeros
    return jax.lax.dot_general(x_pad, rows, _ROWS, preferred_element_type=jnp.float32)


def _pallas_kernel(x_ref: Any, v_ref: Any, s_ref: Any, *rest: Any, w: QuantizedWeight, has_mins: bool) -> None:
    m_ref, o_ref = (rest[0], rest[1]) if has_mins else (None, rest[0])
    tile = dataclasses.replace(
        w, values=v_ref[...], scales=s_ref[...], mins=None if m_ref is None else m_ref[...], shape=w.shape
    )
    rows = dequantize_rows(tile)  # [tile_out, in_pad] f32, in registers / shared memory
    o_ref[...] = jax.lax.dot_general(x_ref[...], rows, _ROWS, preferred_element_type=jnp.float32)


def matmul_pallas(x: jax.Array, w: QuantizedWeight, tile_out: int = 128, interpret: bool = False) -> jax.Array:
    """x [B, in] f32 @ W -> [B, out] f32 as a Pallas kernel: a grid over tiles of `tile_out` output rows, each
    program reading its rows' values, scales and mins once and dequantizing them on chip."""
    from jax.experimental import pallas as pl

    n_out = w.shape[1]
    tile = min(tile_out, n_out)
    grid = -(-n_out // tile)
    x_pad = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, w.in_pad - w.shape[0])))  # [B, in_pad]
    leaves = [w.values, w.scales] + ([] if w.mins is None else [w.mins])
    padded = [jnp.pad(jnp.asarray(a), ((0, grid * tile - n_out), (0, 0))) for a in leaves]  # whole tiles
    specs = [pl.BlockSpec((x_pad.shape[0], x_pad.shape[1]), lambda i: (0, 0))]
    specs += [pl.BlockSpec((tile, a.shape[1]), lambda i: (i, 0)) for a in padded]
    out = pl.pallas_call(
        functools.partial(_pallas_kernel, w=w, has_mins=w.mins is not None),
        grid=(grid,),
        in_specs=specs,
        out_specs=pl.BlockSpec((x_pad.shape[0], tile), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((x_pad.shape[0], grid * tile), jnp.float32),
        interpret=interpret,
    )(x_pad, *padded)
    return out[:, :n_out]


def default_impl() -> Impl:
    """ "cpu_kernel" on the CPU backend where the kernel builds, else "xla"."""
    if jax.default_backend() == "cpu" and cpu_kernel.quant_matmul_target() is not None:
        return "cpu_kernel"
    return "xla"


def quant_matmul(x: jax.Array, w: QuantizedWeight, impl: Impl = "auto", activations: str | None = None) -> jax.Array:
    """x [..., in] f32 @ W [in, out] -> [..., out] f32, W a `QuantizedWeight` (the forms: the module docstring);
    `activations` ("float32" | "int8"; None: the weight's own) is what the C++ kernel's decode multiplies by."""
    if x.shape[-1] != w.shape[0]:
        raise QuantFormatError(f"{w.scheme}: x has {x.shape[-1]} inputs, the weight {w.shape[0]}")
    lead = x.shape[:-1]
    flat = x.reshape(-1, w.shape[0]).astype(jnp.float32)  # [B, in]
    if impl == "auto":
        impl = default_impl() if w.impl == "auto" else w.impl  # type: ignore[assignment]
    if impl == "cpu_kernel" and flat.shape[0] >= DEQUANTIZE_ROWS:
        out = matmul_dequantized(flat, w)
    elif impl == "cpu_kernel":
        out = matmul_cpu_kernel(flat, w, activations)
    elif impl == "pallas":
        out = matmul_pallas(flat, w)
    elif impl == "xla":
        out = matmul_xla(flat, w)
    else:
        raise QuantFormatError(f"unknown quantized-matmul impl {impl!r}")
    return out.reshape(*lead, w.shape[1])


def partition_spec(w: QuantizedWeight, out_axis: str | None = None, in_axis: str | None = None) -> QuantizedWeight:
    """A `QuantizedWeight` of `PartitionSpec`s (the tree `jax.device_put` / `NamedSharding` take) splitting the
    output over `out_axis` and / or the input over `in_axis` (blocks: the axis size must divide their number)."""
    from jax.sharding import PartitionSpec as P

    spec = P(out_axis, in_axis)
    return dataclasses.replace(w, values=spec, scales=spec, mins=None if w.mins is None else spec)


def sharded_matmul(
    x: jax.Array,
    w: QuantizedWeight,
    mesh: jax.sharding.Mesh,
    out_axis: str | None = None,
    in_axis: str | None = None,
    impl: Impl = "auto",
) -> jax.Array:
    """x [B, in] @ W with W split over `mesh` (`partition_spec`): each device multiplies its own rows (and blocks)
    with `impl` (the C++ kernel is a custom call, which XLA cannot split itself: this is how a tp split uses it).
    An `out_axis` split gives [B, out] split over it; an `in_axis` split (x split the same way) sums the
    partial products over that axis (a `psum`). W's arrays must already be laid out as `partition_spec` says."""
    from jax.sharding import PartitionSpec as P

    if in_axis is not None and (w.shape[0] != w.in_pad or w.num_blocks % mesh.shape[in_axis]):
        raise QuantFormatError(
            f"{w.scheme}: an input split needs an unpadded input ({w.shape[0]} vs {w.in_pad}) and a block count "
            f"({w.num_blocks}) that {in_axis}={mesh.shape[in_axis]} divides"
        )

    def local(xs: jax.Array, ws: QuantizedWeight) -> jax.Array:
        part = dataclasses.replace(ws, shape=(int(xs.shape[1]), int(ws.values.shape[0])))  # this device's [in, out]
        y = quant_matmul(xs, part, impl)
        return jax.lax.psum(y, in_axis) if in_axis is not None else y

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(P(None, in_axis), partition_spec(w, out_axis, in_axis)),
        out_specs=P(None, out_axis),
        check_vma=False,
    )(x, w)


def concat_outputs(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The weights side by side along the output (a fused q/k/v or gate/up projection); same scheme and input."""
    first = parts[0]
    for p in parts[1:]:
        if (p.scheme, p.bits, p.block, p.shape[0], p.in_pad) != (
            first.scheme,
            first.bits,
            first.block,
            first.shape[0],
            first.in_pad,
        ) or (p.mins is None) != (first.mins is None):
            raise QuantFormatError(
                f"cannot fuse {p.scheme} (block {p.block}, in {p.shape[0]}) with {first.scheme} "
                f"(block {first.block}, in {first.shape[0]}): the schemes and inputs must match"
            )
    cat = functools.partial(jnp.concatenate, axis=0)
    return checked(
        cat([p.values for p in parts]),
        cat([p.scales for p in parts]),
        None if first.mins is None else cat([p.mins for p in parts]),
        scheme=first.scheme,
        bits=first.bits,
        block=first.block,
        shape=(first.shape[0], sum(p.shape[1] for p in parts)),
    )


def embed_rows(w: QuantizedWeight, ids: jax.Array) -> jax.Array:
    """Rows `ids` of a quantized `[hidden, vocab]` table (GGUF's token embedding, output = vocab) as float32
    `[..., hidden]`: reads and dequantizes only the rows asked for (the tied LM head is `quant_matmul`)."""
    return dequantize_rows(w.take_rows(ids.reshape(-1)))[:, : w.shape[0]].reshape(*ids.shape, w.shape[0])
