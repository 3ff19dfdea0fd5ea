"""Quantized weights (`models.quant`): GGUF blocks kept or repacked, int8 / int4 from float weights, and the
matmul's three forms (XLA, the C++ kernel, Pallas in interpret mode) against a float64 numpy reference.

The reference for GGUF is the `gguf` package's own `gguf.quants.dequantize` (an independent implementation):
every kept type must dequantize to exactly its floats. The matmuls are held to a float32 summation bound:
every form multiplies the same dequantized float32 weights (s q is exact in float32, so s q + m is one
rounding in every form), and only the order of the sums differs, so

    |y - y_ref| <= 2^-20 * sum_i |x_i| |w_io|      (y_ref: float64 over the dequantized weights)

which is 2^4 float32 ulps of the absolute sum; the worst case of any order is in * 2^-24 of it (>= 2^-18 at
in >= 64), and what the forms show is ~2^-23.
"""

from __future__ import annotations

import pickle
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from models import quant
from models.kernels import cpu as cpu_kernel

BOUND = 2.0**-20


def _random_blocks(rng: np.random.Generator, type_name: str, rows: int, cols: int) -> np.ndarray:
    """Raw GGUF rows `[rows, bytes]` of `type_name`: the 32-element types quantized from random floats by the
    `gguf` package; the K-quants random bytes whose float16 fields are made finite."""
    kind = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(w, kind)
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
    # float16 fields (d, dmin; Q6_K: d at the end) set to finite values of mixed sign and magnitude
    fields = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]
    for at in fields:
        value = (rng.standard_normal((rows, cols // block)) * 0.05).astype(np.float16)
        raw[..., at : at + 2] = value.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", quant.GGUF_TYPES)
def test_gguf_blocks_dequantize_to_exactly_what_gguf_gives(type_name: str) -> None:
    rng = np.random.default_rng(1)
    rows, cols = 7, 512
    raw = _random_blocks(rng, type_name, rows, cols)
    w = quant.from_gguf(raw, type_name, cols)
    assert w.shape == (cols, rows) and w.scheme == type_name.lower()
    ours = np.asarray(w.dequantize()).T  # [rows, cols]
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).reshape(rows, cols)
    np.testing.assert_array_equal(ours, theirs.astype(np.float32))
    # kept as stored: the 32-element types' values and scales take the file's bytes (no more)
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):
        assert w.nbytes() == raw.nbytes


def test_unsupported_gguf_type_is_named() -> None:
    with pytest.raises(quant.UnsupportedQuantizationError, match="Q5_0"):
        quant.from_gguf(np.zeros((2, 22), np.uint8), "Q5_0", 32)


def test_int8_per_channel_round_trip_within_half_a_step() -> None:
    rng = np.random.default_rng(2)
    w = rng.standard_normal((100, 37)).astype(np.float32) * np.linspace(0.01, 3, 37, dtype=np.float32)
    q = quant.quantize_int8(w)
    assert q.bits == 8 and q.block == q.in_pad == 128 and q.scales.shape == (37, 1)
    deq = np.asarray(q.dequantize())
    step = np.asarray(q.scales)[:, 0]  # [out]
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6))
    assert q.nbytes() < w.nbytes / 3  # ~1 byte a weight (the padding to 128 inputs included)


def test_int4_group_wise_round_trip_within_half_a_step() -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((200, 37)).astype(np.float32)
    q = quant.quantize_int4(w, group=64)
    assert q.bits == 4 and q.block == 64 and q.in_pad == 256 and q.values.shape == (37, 128)
    deq = np.asarray(q.dequantize())  # [in, out]
    step = np.repeat(np.asarray(q.scales), 64, axis=1)[:, :200].T  # [in, out]
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-5) + 1e-7)


def _weights(rng: np.random.Generator) -> list[quant.QuantizedWeight]:
    """Every scheme, on shapes whose in / out are not multiples of the block where the format allows it."""
    out = [
        quant.quantize_int8(rng.standard_normal((100, 37)).astype(np.float32)),
        quant.quantize_int4(rng.standard_normal((200, 37)).astype(np.float32), group=64),
        quant.quantize_int4(rng.standard_normal((45, 3)).astype(np.float32), group=32),
    ]
    for type_name, cols in (("Q8_0", 96), ("Q4_0", 160), ("Q4_1", 576), ("Q4_K", 256), ("Q5_K", 512), ("Q6_K", 256)):
        out.append(quant.from_gguf(_random_blocks(rng, type_name, 37, cols), type_name, cols))
    return out


def _check(y: np.ndarray, x: np.ndarray, w: quant.QuantizedWeight) -> None:
    deq = np.asarray(w.dequantize(), np.float64)  # [in, out]
    ref = x.astype(np.float64) @ deq
    scale = np.abs(x).astype(np.float64) @ np.abs(deq)
    assert y.shape == ref.shape and y.dtype == np.float32
    err = np.abs(y - ref)
    assert np.all(err <= BOUND * scale + 1e-30), f"{w.scheme}: worst {float((err / (scale + 1e-30)).max())}"


@pytest.fixture(scope="module")
def kernel() -> str:
    target = cpu_kernel.quant_matmul_target()
    if target is None:
        pytest.skip(f"no CPU quantized-matmul kernel here: {cpu_kernel.quant_build_error()}")
    return target


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_kernel_equals_xla_form_equals_numpy(kernel: str, batch: int) -> None:
    rng = np.random.default_rng(10 + batch)
    for w in _weights(rng):
        x = rng.standard_normal((batch, w.shape[0])).astype(np.float32)
        y_xla = np.asarray(jax.jit(quant.matmul_xla)(jnp.asarray(x), w))
        y_kernel = np.asarray(jax.jit(quant.matmul_cpu_kernel)(jnp.asarray(x), w))
        _check(y_xla, x, w)
        _check(y_kernel, x, w)


def _int8_x(x: np.ndarray) -> np.ndarray:
    """x quantized as the kernel's int8 decode does (per 32-block: q = rint(x * 127 / amax), d = amax / 127, the
    same float32 operations) and dequantized, float64 d q: the int8 form is exactly x_q @ W in real arithmetic."""
    pad = -x.shape[1] % 32
    xb = np.pad(x, ((0, 0), (0, pad))).reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    q = np.rint(xb * inv.astype(np.float32))
    d = (amax / np.float32(127)).astype(np.float32)
    assert np.abs(q).max() <= 127
    return (q.astype(np.float64) * d).reshape(x.shape[0], -1)[:, : x.shape[1]]


def _unsigned_term(w: quant.QuantizedWeight) -> np.ndarray:
    """[in, out] |s u| + |m'| of the kernel's unsigned form w = s u + m' (u a nibble, or an int8 value + 128 with
    m' = m - 128 s): the size of the terms its int8 form sums, which bounds its float rounding."""
    s = np.repeat(np.asarray(w.scales, np.float64), w.block, axis=1)  # [out, in_pad]
    m = 0.0 if w.mins is None else np.repeat(np.asarray(w.mins, np.float64), w.block, axis=1)
    m = m - (128 if w.bits == 8 else 8 if w.mins is None else 0) * s
    deq = np.asarray(w.dequantize(), np.float64).T  # [out, in]
    u_term = np.abs(deq - m[:, : w.shape[0]])  # |s u|
    return (u_term + np.abs(m[:, : w.shape[0]])).T


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_int8_activations_are_the_int8_arithmetic_within_rounding_of_float32(kernel: str, batch: int) -> None:
    """`activations="int8"` (block-32 schemes, batch <= 4) is x quantized per 32-block times W: against float64
    x_q @ W within float32 rounding of its terms (the integer dot products are exact), and against the float32
    form within what rounding x moved: |x - x_q| <= d / 2 a value, so |y - y_f32| <= sum_i d_i / 2 |w_io|."""
    if not cpu_kernel.int8_activations_supported():
        pytest.skip("no AVX512-VNNI here: int8 activations run the float32 form")
    rng = np.random.default_rng(20 + batch)
    served = 0
    for w in _weights(rng):
        x = rng.standard_normal((batch, w.shape[0])).astype(np.float32)
        x[0, : min(32, w.shape[0])] = 0.0  # an all-zero block: d = 0, no division by it
        y8 = np.asarray(jax.jit(quant.matmul_cpu_kernel, static_argnums=2)(jnp.asarray(x), w, "int8"))
        y32 = np.asarray(quant.matmul_cpu_kernel(jnp.asarray(x), w, "float32"))
        if w.block != 32:  # other formats: the float32 form, whatever was asked
            np.testing.assert_array_equal(y8, y32)
            continue
        served += 1
        deq = np.asarray(w.dequantize(), np.float64)
        xq = _int8_x(x)
        ref = xq @ deq
        bound = 2.0**-18 * (np.abs(xq) @ _unsigned_term(w))
        assert np.all(np.abs(y8 - ref) <= bound + 1e-30), w.scheme
        half_step = np.abs(x.astype(np.float64) - xq)  # <= d / 2 a value
        assert np.all(half_step.reshape(batch, -1) <= np.abs(x).max() / 254 * (1 + 1e-6))
        moved = half_step @ np.abs(deq)
        assert np.all(np.abs(y8 - y32) <= moved + 2.0**-18 * (np.abs(xq) @ _unsigned_term(w)) + 1e-30), w.scheme
        assert not np.array_equal(y8, y32)  # the int8 form ran
    assert served >= 5  # Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and int4 group 32


def test_int8_activations_fall_back_to_float32_past_four_rows(kernel: str) -> None:
    rng = np.random.default_rng(30)
    w = quant.from_gguf(_random_blocks(rng, "Q4_1", 37, 576), "Q4_1", 576)
    x = jnp.asarray(rng.standard_normal((5, 576)).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(quant.matmul_cpu_kernel(x, w, "int8")), np.asarray(quant.matmul_cpu_kernel(x, w, "float32"))
    )
    with pytest.raises(quant.QuantFormatError, match="activations"):
        quant.matmul_cpu_kernel(x, w, "int4")


def test_kernel_dequantizes_every_scheme_for_many_rows(kernel: str) -> None:
    """The prefill path (x with >= `DEQUANTIZE_ROWS` rows): the kernel's dequantizing handler writes each weight
    as the XLA form computes it (s q + m: at most one rounding apart, the kernel's is one fma), threaded on a
    weight past its threshold, and XLA's GEMM multiplies."""
    rng = np.random.default_rng(7)
    big = quant.quantize_int4(rng.standard_normal((576, 1001)).astype(np.float32), group=64)  # threaded
    for w in [*_weights(rng), big]:
        got = np.asarray(jax.jit(quant.dequantize_cpu_kernel)(w))
        ref = np.asarray(quant.dequantize_rows(w))
        assert got.shape == ref.shape == (w.shape[1], w.in_pad)
        # one rounding of s q + m apart (an fma against a multiply and an add): within an ulp of the weight's scale
        np.testing.assert_allclose(got, ref, rtol=0, atol=2**-22 * float(np.abs(ref).max()))
        x = rng.standard_normal((quant.DEQUANTIZE_ROWS + 3, w.shape[0])).astype(np.float32)
        y = np.asarray(jax.jit(quant.quant_matmul, static_argnames="impl")(jnp.asarray(x), w, impl="cpu_kernel"))
        _check(y, x, w)


def test_kernel_shares_rows_with_threads_and_keeps_leading_dims(kernel: str) -> None:
    """A weight large enough for the kernel's threaded path (>= 96 KiB), odd batch sizes around its tiles, and
    x with leading dims as a model passes it."""
    rng = np.random.default_rng(4)
    w = quant.quantize_int4(rng.standard_normal((576, 1001)).astype(np.float32), group=64)
    for lead in ((1,), (5,), (2, 3), (9,)):
        x = rng.standard_normal((*lead, 576)).astype(np.float32)
        y = np.asarray(jax.jit(quant.quant_matmul, static_argnames="impl")(jnp.asarray(x), w, impl="cpu_kernel"))
        assert y.shape == (*lead, 1001)
        _check(y.reshape(-1, 1001), x.reshape(-1, 576), w)


def test_pallas_form_in_interpret_mode() -> None:
    rng = np.random.default_rng(5)
    for w in _weights(rng)[::2]:
        x = rng.standard_normal((3, w.shape[0])).astype(np.float32)
        y = np.asarray(quant.matmul_pallas(jnp.asarray(x), w, tile_out=16, interpret=True))
        _check(y, x, w)


def test_tp_split_over_eight_devices_gives_the_same_product(kernel: str) -> None:
    devices = np.array(jax.devices()[:8])
    assert devices.size == 8, "conftest asks for 8 virtual CPU devices"
    mesh = Mesh(devices, ("tp",))
    rng = np.random.default_rng(6)
    cases = [
        quant.quantize_int8(rng.standard_normal((100, 96)).astype(np.float32)),
        quant.from_gguf(_random_blocks(rng, "Q4_1", 96, 256), "Q4_1", 256),
        quant.from_gguf(_random_blocks(rng, "Q6_K", 40, 256), "Q6_K", 256),
    ]
    for w in cases:
        x = jnp.asarray(rng.standard_normal((3, w.shape[0])).astype(np.float32))
        whole = np.asarray(quant.matmul_cpu_kernel(x, w))
        # OUTPUT split: every leaf's rows go with their scales; XLA's form through jit's own partitioning, the
        # kernel through shard_map (each device its rows): the kernel's rows are computed as unsplit, bit for bit
        out_split = jax.device_put(w, jax.tree.map(lambda s: NamedSharding(mesh, s), quant.partition_spec(w, "tp")))
        assert out_split.scales.sharding.shard_shape(out_split.scales.shape)[0] == w.shape[1] // 8
        y_xla = jax.jit(quant.matmul_xla)(x, out_split)
        _check(np.asarray(y_xla), np.asarray(x), w)
        y_kernel = quant.sharded_matmul(x, out_split, mesh, out_axis="tp", impl="cpu_kernel")
        np.testing.assert_array_equal(np.asarray(y_kernel), whole)
    # INPUT split at block boundaries (256 inputs = 8 blocks of 32): partial products summed over the devices
    w = cases[1]
    x = jnp.asarray(rng.standard_normal((3, 256)).astype(np.float32))
    in_split = jax.device_put(w, jax.tree.map(lambda s: NamedSharding(mesh, s), quant.partition_spec(w, None, "tp")))
    for impl in ("cpu_kernel", "xla"):
        y = quant.sharded_matmul(x, in_split, mesh, in_axis="tp", impl=impl)
        _check(np.asarray(y), np.asarray(x), w)
    with pytest.raises(quant.QuantFormatError, match="input split"):
        quant.sharded_matmul(x[:, :100], cases[0], mesh, in_axis="tp")


def test_rows_embedding_and_fused_outputs() -> None:
    rng = np.random.default_rng(7)
    table = quant.from_gguf(_random_blocks(rng, "Q4_1", 50, 64), "Q4_1", 64)  # [hidden 64, vocab 50]
    ids = jnp.asarray([[3, 49], [0, 3]])
    rows = np.asarray(quant.embed_rows(table, ids))
    np.testing.assert_array_equal(rows, np.asarray(table.dequantize()).T[np.asarray(ids)])
    a, b = quant.quantize_int4(rng.standard_normal((64, 5)), 32), quant.quantize_int4(rng.standard_normal((64, 7)), 32)
    fused = quant.concat_outputs([a, b])
    np.testing.assert_array_equal(
        np.asarray(fused.dequantize()), np.concatenate([np.asarray(a.dequantize()), np.asarray(b.dequantize())], 1)
    )
    with pytest.raises(quant.QuantFormatError, match="cannot fuse"):
        quant.concat_outputs([a, quant.quantize_int8(rng.standard_normal((64, 3)))])


def test_bad_parts_raise_one_clear_error() -> None:
    rng = np.random.default_rng(8)
    good = quant.quantize_int4(rng.standard_normal((64, 5)).astype(np.float32), group=32)

    def parts(values: Any = good.values, scales: Any = good.scales, scheme: str = "int4", block: int = 32) -> Any:
        return quant.checked(values, scales, good.mins, scheme=scheme, bits=4, block=block, shape=(64, 5))

    with pytest.raises(quant.QuantFormatError, match=r"scales must be float16 or float32 \[out, blocks\] = \[5, 2\]"):
        parts(scales=good.scales[:, :1])  # a corrupt scale tensor
    with pytest.raises(quant.QuantFormatError, match="unknown quantization scheme 'int3'"):
        parts(scheme="int3")
    with pytest.raises(quant.QuantFormatError, match="values must be uint8"):
        parts(values=good.values.view(np.int8))
    with pytest.raises(quant.QuantFormatError, match="block 48"):
        parts(block=48)
    with pytest.raises(quant.QuantFormatError, match="Q4_1: 64 columns"):
        quant.from_gguf(np.zeros((2, 30), np.uint8), "Q4_1", 64)  # rows one block short
    with pytest.raises(quant.QuantFormatError, match="x has 63 inputs"):
        quant.quant_matmul(jnp.zeros((1, 63)), good)


def test_without_the_kernel_the_xla_form_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel switched off (or no compiler): "auto" picks the XLA form, and the reason is there to read."""
    monkeypatch.setattr(cpu_kernel, "_quant_state", [])
    monkeypatch.setenv("JAXSERVE_CPU_KERNEL", "0")
    assert cpu_kernel.quant_matmul_target() is None and "JAXSERVE_CPU_KERNEL" in cpu_kernel.quant_build_error()
    assert quant.default_impl() == "xla"
    rng = np.random.default_rng(9)
    w = quant.quantize_int8(rng.standard_normal((64, 9)).astype(np.float32))
    x = rng.standard_normal((2, 64)).astype(np.float32)
    _check(np.asarray(quant.quant_matmul(jnp.asarray(x), w)), x, w)
    with pytest.raises(RuntimeError, match="JAXSERVE_CPU_KERNEL"):
        quant.matmul_cpu_kernel(jnp.asarray(x), w)


@pytest.mark.slow
@pytest.mark.parametrize("isa", [("-mavx2", "-mfma", "-mf16c", "-mno-avx512f"), ("-mno-avx", "-mno-avx2")])
def test_avx2_and_plain_builds_compute_the_same(isa: tuple[str, ...]) -> None:
    """The kernel's AVX2 (+ FMA, F16C) and plain-loop code paths, built here with those flags instead of
    -march=native and registered as targets of their own, on every scheme and the batch tiles (1-4, > 4)."""
    cxx = cpu_kernel.compiler()
    if cxx is None or not cpu_kernel.enabled():
        pytest.skip("no C++ compiler here")
    lib = cpu_kernel._build(cxx, *cpu_kernel._jaxlib(), source_path=cpu_kernel.QUANT_SOURCE, isa=isa)
    target = f"jaxserve_quant_matmul_test_{'avx2' if '-mavx2' in isa else 'plain'}"
    if target not in cpu_kernel._registered:
        cpu_kernel._register(target, lib, cpu_kernel._QUANT_SYMBOL)
    rng = np.random.default_rng(11)
    for w in _weights(rng):
        for batch in (1, 3, 6):
            x = rng.standard_normal((batch, w.shape[0])).astype(np.float32)
            y = np.asarray(jax.jit(quant._kernel_call, static_argnums=0)(target, jnp.asarray(x), w))
            _check(y, x, w)


def test_stacked_layers_scan_and_pickle(kernel: str) -> None:
    """Per-layer weights stacked into [L, ...] leaves (checkpoints, a pipeline stage's scan) slice back into
    weights the kernel takes; a weight crosses a process boundary (Ray) by pickle unchanged."""
    rng = np.random.default_rng(12)
    layers = [quant.from_gguf(_random_blocks(rng, "Q4_1", 24, 64), "Q4_1", 64) for _ in range(3)]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    assert stacked.values.shape == (3, 24, 32) and stacked.shape == (64, 24)
    x0 = rng.standard_normal((2, 24)).astype(np.float32)
    proj = quant.quantize_int8(rng.standard_normal((24, 64)).astype(np.float32))  # back to 64 inputs

    def body(x: jax.Array, w: quant.QuantizedWeight) -> tuple[jax.Array, None]:
        return quant.matmul_cpu_kernel(quant.matmul_cpu_kernel(x, proj), w), None

    got, _ = jax.jit(lambda x, ws: jax.lax.scan(body, x, ws))(jnp.asarray(x0), stacked)
    want = jnp.asarray(x0)
    for w in layers:
        want = quant.matmul_cpu_kernel(quant.matmul_cpu_kernel(want, proj), w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    back = pickle.loads(pickle.dumps(layers[0]))
    assert (back.scheme, back.bits, back.block, back.shape) == ("q4_1", 4, 32, (64, 24))
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(layers[0].dequantize()))
