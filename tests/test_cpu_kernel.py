"""The CPU paged-attention kernel (`models/kernels/paged_attention_cpu.cc`, impl="cpu_kernel"): built here with
the machine's compiler, checked against a float64 numpy reference over head-major pools (MHA, GQA 3:1 and 4:1,
MQA), its checked build's errors on bad indices, the release build's clamping, and its fallbacks.

The suite runs the checked build (`JAXSERVE_KERNEL_CHECKS=1`, tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kernels import cpu as cpu_kernel
from models.paged_attention import cpu_kernel_applies, default_impl, paged_decode_attention

needs_compiler = pytest.mark.skipif(cpu_kernel.compiler() is None, reason="no C++ compiler on this machine")


def _reference(q, kp, vp, tables, lengths, layer, scale, new_kv=None) -> np.ndarray:
    """Softmax attention of each row's first lengths[b] positions (pool [L, N, KVH, bs, D]) and new_kv ([B, KVH,
    D]), in float64; query head h reads K/V head h // (H // KVH), as repeat_kv lays them out."""
    b, h, d = q.shape
    bs, group = kp.shape[3], h // kp.shape[2]
    out = np.zeros((b, h, d))
    for r in range(b):
        pos = np.arange(lengths[r])
        k = kp[layer, tables[r, pos // bs], :, pos % bs].astype(np.float64)  # [S, KVH, D]
        v = vp[layer, tables[r, pos // bs], :, pos % bs].astype(np.float64)
        if new_kv is not None:
            k = np.concatenate([k, new_kv[0][r][None].astype(np.float64)])
            v = np.concatenate([v, new_kv[1][r][None].astype(np.float64)])
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [S, H, D]
        if len(k) == 0:
            continue  # nothing to attend: zeros, as the XLA forms give
        s = np.einsum("hd,shd->hs", q[r].astype(np.float64), k) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        out[r] = np.einsum("hs,shd->hd", p / p.sum(-1, keepdims=True), v)
    return out


def _case(head_dim: int, seed: int = 0, batch: int = 5, heads: int = 3, bs: int = 16, width: int = 6,
          kv_heads: int | None = None):  # fmt: skip
    rng = np.random.default_rng(seed)
    layers, blocks, kvh = 2, batch * width + 3, kv_heads or heads
    q = rng.standard_normal((batch, heads, head_dim)).astype(np.float32)
    kp = rng.standard_normal((layers, blocks, kvh, bs, head_dim)).astype(np.float32)
    vp = rng.standard_normal((layers, blocks, kvh, bs, head_dim)).astype(np.float32)
    tables = rng.permutation(blocks)[: batch * width].reshape(batch, width).astype(np.int32)  # shuffled
    # a full table, a partial last block, one block exactly, a single position, nothing
    lengths = np.array([width * bs, 37, bs, 1, 0][:batch], np.int32)
    new_kv = tuple(rng.standard_normal((batch, kvh, head_dim)).astype(np.float32) for _ in range(2))
    return q, kp, vp, tables, lengths, new_kv


# (query heads, K/V heads): MHA, GQA 3:1, GQA 4:1, MQA
HEAD_CONFIGS = [(3, 3), (6, 2), (8, 2), (4, 1)]


@needs_compiler
def test_the_kernel_builds_here_and_is_the_cpu_default() -> None:
    assert cpu_kernel.checks_enabled()  # tests/conftest.py: the suite runs the checked build
    assert cpu_kernel.paged_attention_target() == cpu_kernel.CHECKED_TARGET, cpu_kernel.build_error()
    assert default_impl() == "cpu_kernel"
    assert cpu_kernel_applies(jnp.float32, jnp.float32) and cpu_kernel_applies(jnp.bfloat16, jnp.bfloat16)
    assert not cpu_kernel_applies(jnp.float16, jnp.float16)  # the XLA loop serves other dtypes
    assert not cpu_kernel_applies(jnp.float32, jnp.bfloat16)
    built = list(cpu_kernel.cache_dir().glob("paged_attention_cpu-*.so"))
    assert built and str(cpu_kernel.cache_dir()).startswith(os.environ["JAXSERVE_KERNEL_CACHE"])


@needs_compiler
@pytest.mark.parametrize(("heads", "kv_heads"), HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [16, 32, 48, 64, 128])  # 32 / 64 / 128: the vector path; 16, 48: the plain one
def test_matches_the_reference(head_dim: int, heads: int, kv_heads: int) -> None:
    q, kp, vp, tables, lengths, new_kv = _case(head_dim, heads=heads, kv_heads=kv_heads)
    scale = head_dim**-0.5
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables), jnp.asarray(lengths))
    for layer in (0, 1):
        got = paged_decode_attention(*args, scale=scale, impl="cpu_kernel", layer=layer, block_layout="heads",
                                     new_kv=(jnp.asarray(new_kv[0]), jnp.asarray(new_kv[1])))  # fmt: skip
        want = _reference(q, kp, vp, tables, lengths, layer, scale, new_kv)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
        alone = np.repeat(new_kv[1][4], heads // kv_heads, axis=0)  # no pages: the new value itself, per query head
        np.testing.assert_allclose(np.asarray(got)[4], alone, atol=1e-6)
    got = paged_decode_attention(*args, scale=scale, impl="cpu_kernel", layer=1, block_layout="heads")
    want = _reference(q, kp, vp, tables, lengths, 1, scale)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[4].any()  # nothing attended at all: zeros
    # no layer axis: one layer's pool
    got = paged_decode_attention(jnp.asarray(q), jnp.asarray(kp[1]), jnp.asarray(vp[1]), *args[3:], scale=scale,
                                 impl="cpu_kernel", block_layout="heads")  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.parametrize("kv_heads", [12, 4])
def test_traced_layer_under_jit_and_many_rows(kv_heads: int) -> None:
    """The layer index as a traced value (the engine's layer loop), 64 rows x 12 heads spread over the threads."""
    q, kp, vp, tables, lengths, new_kv = _case(64, seed=1, batch=64, heads=12, bs=16, width=4, kv_heads=kv_heads)
    lengths = np.random.default_rng(2).integers(0, 4 * 16 + 1, 64).astype(np.int32)

    @jax.jit
    def both_layers(q, kp, vp, tables, lengths, kn, vn):
        def one(i, acc):
            o = paged_decode_attention(q, kp, vp, tables, lengths, scale=0.125, impl="cpu_kernel", layer=i,
                                       new_kv=(kn, vn), block_layout="heads")  # fmt: skip
            return acc.at[i].set(o)

        return jax.lax.fori_loop(0, 2, one, jnp.zeros((2, *q.shape), jnp.float32))

    got = np.asarray(both_layers(q, kp, vp, tables, lengths, *new_kv))
    for layer in (0, 1):
        want = _reference(q, kp, vp, tables, lengths, layer, 0.125, new_kv)
        np.testing.assert_allclose(got[layer], want, atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.parametrize(("heads", "kv_heads"), [(3, 3), (8, 2)])
def test_bfloat16_pool(heads: int, kv_heads: int) -> None:
    q, kp, vp, tables, lengths, new_kv = _case(64, seed=3, heads=heads, kv_heads=kv_heads)
    bf = jnp.bfloat16
    qb, kb, vb = jnp.asarray(q, bf), jnp.asarray(kp, bf), jnp.asarray(vp, bf)
    nb = (jnp.asarray(new_kv[0], bf), jnp.asarray(new_kv[1], bf))
    got = paged_decode_attention(qb, kb, vb, jnp.asarray(tables), jnp.asarray(lengths), scale=0.125,
                                 impl="cpu_kernel", layer=1, new_kv=nb, block_layout="heads")  # fmt: skip
    as64 = [np.asarray(x.astype(jnp.float32)) for x in (qb, kb, vb, *nb)]  # the same rounded inputs
    want = _reference(as64[0], as64[1], as64[2], tables, lengths, 1, 0.125, (as64[3], as64[4]))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


@needs_compiler
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(6, 2, 64), (8, 2, 16), (4, 1, 32)])
def test_grouped_equals_the_kernel_on_a_pool_repeated_per_query_head(heads: int, kv_heads: int, head_dim: int) -> None:
    """Reading each K/V block once per group changes no arithmetic: bit for bit the MHA kernel (one item per query
    head) over the pool with every K/V head repeated for its group's query heads (what repeat_kv would build)."""
    q, kp, vp, tables, lengths, new_kv = _case(head_dim, seed=6, heads=heads, kv_heads=kv_heads)
    g = heads // kv_heads
    args = (jnp.asarray(q), jnp.asarray(tables), jnp.asarray(lengths))
    grouped = paged_decode_attention(args[0], jnp.asarray(kp), jnp.asarray(vp), *args[1:], scale=0.3,
                                     impl="cpu_kernel", layer=1, block_layout="heads",
                                     new_kv=(jnp.asarray(new_kv[0]), jnp.asarray(new_kv[1])))  # fmt: skip
    repeated = paged_decode_attention(args[0], jnp.asarray(np.repeat(kp, g, axis=2)), jnp.asarray(np.repeat(vp, g, 2)),
                                      *args[1:], scale=0.3, impl="cpu_kernel", layer=1, block_layout="heads",
                                      new_kv=(jnp.asarray(np.repeat(new_kv[0], g, axis=1)),
                                              jnp.asarray(np.repeat(new_kv[1], g, axis=1))))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(grouped), np.asarray(repeated))


@needs_compiler
@pytest.mark.parametrize("head_dim", [64, 16])  # the vector path and the plain one share the handler's check
def test_checked_build_names_a_bad_block_id_or_length(head_dim: int) -> None:
    """The checked build (what the tests run) refuses an out-of-range block id, length or layer, naming it,
    through the FFI error path; table columns past a row's length are not read, so they may hold anything."""
    q, kp, vp, tables, lengths, _ = _case(head_dim, seed=4, heads=4, kv_heads=2)
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp))

    def run(tables: np.ndarray, lengths: np.ndarray, layer: int = 0) -> np.ndarray:
        return np.asarray(paged_decode_attention(*args, jnp.asarray(tables), jnp.asarray(lengths), scale=0.125,
                                                 impl="cpu_kernel", layer=layer, block_layout="heads"))  # fmt: skip

    for row, column, bad_id in [(0, 1, 10_000), (1, 0, -7), (2, 0, kp.shape[1])]:
        bad = tables.copy()
        bad[row, column] = bad_id
        message = f"row {row} table column {column} names block id {bad_id}, outside the pool's {kp.shape[1]} blocks"
        with pytest.raises(jax.errors.JaxRuntimeError, match=message):
            run(bad, lengths)
    for length in (10_000, -1):
        longer = lengths.copy()
        longer[3] = length
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"row 3 length {length} outside \\[0, 96\\]"):
            run(tables, longer)
    with pytest.raises(jax.errors.JaxRuntimeError, match="layer index 2 outside the pool's 2 layers"):
        run(tables, lengths, layer=2)
    padded = tables.copy()
    padded[1, 3:] = 10_000  # row 1 reads 37 positions: columns 0-2 only
    np.testing.assert_allclose(run(padded, lengths), _reference(q, kp, vp, tables, lengths, 0, 0.125), atol=2e-5)


@needs_compiler
@pytest.mark.slow  # ~15 s: builds the release variant (the suite runs the checked one)
def test_release_build_clamps_bad_table_entries_into_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The release build (`JAXSERVE_KERNEL_CHECKS` unset): a block id outside the pool reads the nearest block (a
    negative one block 0), never memory outside the pool; a length past the table is cut at the table's end. (The
    engine writes neither: this is the kernel's guard, not a meaning; the checked build raises instead.)"""
    monkeypatch.setenv("JAXSERVE_KERNEL_CHECKS", "0")
    assert cpu_kernel.paged_attention_target() == cpu_kernel.TARGET, cpu_kernel.build_error()
    q, kp, vp, tables, lengths, _ = _case(64, seed=4, heads=4, kv_heads=2)
    bad = tables.copy()
    bad[0, 1], bad[1, 0] = 10_000, -7
    clamped = np.clip(bad, 0, kp.shape[1] - 1)
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp))
    got = paged_decode_attention(*args, jnp.asarray(bad), jnp.asarray(lengths), scale=0.125, impl="cpu_kernel",
                                 layer=0, block_layout="heads")  # fmt: skip
    want = _reference(q, kp, vp, clamped, lengths, 0, 0.125)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    longer = lengths.copy()
    longer[0] = 10_000
    got = paged_decode_attention(*args, jnp.asarray(tables), jnp.asarray(longer), scale=0.125, impl="cpu_kernel",
                                 layer=0, block_layout="heads")  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), _reference(q, kp, vp, tables, lengths, 0, 0.125), atol=2e-5)


@needs_compiler
@pytest.mark.slow  # ~45 s: three compiler runs; the default run stays well under 15 minutes
def test_the_build_is_cached_per_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second build of the same source in the same cache reuses the library; the checked variant and an edited
    source build anew."""
    import jaxlib

    monkeypatch.setenv("JAXSERVE_KERNEL_CACHE", str(tmp_path))
    cxx = cpu_kernel.compiler()
    assert cxx is not None
    first = cpu_kernel._build(cxx, jax.ffi.include_dir(), jaxlib.__version__)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernel._build(cxx, jax.ffi.include_dir(), jaxlib.__version__) == first
    assert first.stat().st_mtime_ns == stamp and first.parent == tmp_path
    checked = cpu_kernel._build(cxx, jax.ffi.include_dir(), jaxlib.__version__, checked=True)  # its own flag, key
    assert checked != first and checked.exists() and first.exists()
    edited = tmp_path / "edited.cc"
    edited.write_text(cpu_kernel.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", edited)
    second = cpu_kernel._build(cxx, jax.ffi.include_dir(), jaxlib.__version__)
    assert second != first and second.exists()
    assert not list(tmp_path.glob("*.tmp"))  # no half-written library left behind


def test_without_the_kernel_the_xla_loop_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or the kernel switched off): the default is the XLA loop, impl="cpu_kernel" computes the same
    attention through it, and the reason is there to read."""
    q, kp, vp, tables, lengths, new_kv = _case(32, seed=5)
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("JAXSERVE_CPU_KERNEL", "0")
    assert cpu_kernel.paged_attention_target() is None and "JAXSERVE_CPU_KERNEL" in cpu_kernel.build_error()
    assert default_impl() == "xla_heads_flat"
    got = paged_decode_attention(jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tables),
                                 jnp.asarray(lengths), scale=0.2, impl="cpu_kernel", layer=1, block_layout="heads",
                                 new_kv=(jnp.asarray(new_kv[0]), jnp.asarray(new_kv[1])))  # fmt: skip
    want = _reference(q, kp, vp, tables, lengths, 1, 0.2, new_kv)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setenv("JAXSERVE_CPU_KERNEL", "1")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_kernel, "_registered", set())  # as in a fresh process that must build
    assert cpu_kernel.paged_attention_target() is None and "nonexistent" in cpu_kernel.build_error()


@needs_compiler
def test_an_early_build_runs_aside_and_the_first_user_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`start_build` (serve's first step) runs the compiler on a thread; a model built meanwhile takes "cpu_kernel"
    without waiting (`default_impl(wait=False)`), and the first caller that needs the kernel takes that build."""
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "_pending", {})
    monkeypatch.setattr(cpu_kernel, "_registered", set())  # as in a fresh process
    cpu_kernel.start_build()
    _, build = cpu_kernel._pending[True]  # the suite's checked variant
    assert default_impl(wait=False) == "cpu_kernel"
    cpu_kernel.start_build()  # started once
    assert cpu_kernel._pending[True][1] is build
    library = build.result(timeout=300)
    assert library.exists() and library.parent == cpu_kernel.cache_dir()

    def build_again(*args: object) -> Path:
        raise AssertionError("built a second time")

    monkeypatch.setattr(cpu_kernel, "_build", build_again)
    assert cpu_kernel.paged_attention_target() == cpu_kernel.CHECKED_TARGET, cpu_kernel.build_error()
    assert not cpu_kernel._pending  # taken


def test_a_failed_early_build_leaves_the_xla_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """An early build that fails: the model took "cpu_kernel" while it ran; its first paged step learns the
    kernel is not there (and why), and impl="cpu_kernel" runs the XLA loop, the default from then on."""
    monkeypatch.setattr(cpu_kernel, "_state", {})
    monkeypatch.setattr(cpu_kernel, "_pending", {})
    monkeypatch.setattr(cpu_kernel, "_registered", set())
    monkeypatch.setenv("JAXSERVE_CPU_KERNEL", "1")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    cpu_kernel.start_build()
    assert default_impl(wait=False) == "cpu_kernel"  # not known yet: the build is under way (or not taken)
    assert cpu_kernel.paged_attention_target() is None and "nonexistent" in cpu_kernel.build_error()
    assert default_impl(wait=False) == "xla_heads_flat" and not cpu_kernel_applies(jnp.float32, jnp.float32)
