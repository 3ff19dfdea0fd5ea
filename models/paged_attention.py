"""Decode attention over a paged KV pool: one function, XLA implementations and a Pallas one.

Grouped queries (GQA / MQA: `q` has H heads, a multiple of the pool's KVH; query head h reads K/V
head h // G, G = H // KVH) are attended group by group in every implementation, so each K/V block is
read once per group of G query heads and never repeated: the XLA forms view q [B, KVH, G, D] and
contract it against K/V as stored ("xla_gather": `_xla_gather_grouped`; every other XLA impl the
chunked loop with an online softmax, `_xla_chunked_grouped`: head-major blocks as "xla_heads_flat"
reads them, token-major ones transposed per chunk); the C++ kernel runs one work item per (row, K/V
head) that attends the group's G query heads to each block while it is in cache; the Pallas kernel
tiles the group's query heads against each page. With H == KVH (MHA, OPT) every form runs exactly
its ungrouped code.

`paged_decode_attention(q, k_pages, v_pages, block_tables, lengths)` attends one query per row
to the first `lengths[b]` positions of row b's pages (position p in block `block_tables[b, p //
block_size]`, slot `p % block_size`). The pool is one layer of the engine's pool, `[num_blocks,
block_size, H, D]` (`block_layout="tokens"`) or `[num_blocks, H, block_size, D]` (`"heads"`), or
the whole pool `[L, ...]` with `layer=i` (the gather then reads layer i in place: slicing the
layer out first is a copy of it on XLA:CPU). `new_kv=(k, v)` adds one more position
per row that is not in the pages (a decode step's own token) to the same softmax.

* `impl="xla"` (the function's default): a loop over chunks of table columns (`CHUNK_BYTES`) that
  stops after the longest row's last filled block, with an online (flash-decoding) softmax. Each
  chunk's blocks are gathered, put head-major ([B, H, S, D], see `models.attention.decode_attention` for
  why) and attended while they are still in cache. The engine buckets table widths to powers of
  two, so up to half a table's columns are empty: they are never read. One chunk is small enough
  that its gather and transpose stay in the CPU's caches instead of streaming the whole
  gathered context through memory twice (docs/performance.md has the A/B);
* `impl="xla_tokens"` (opt-in, CPU): the same loop, but each chunk is attended as gathered,
  token-major [B, C*bs, H, D], with the products written as multiply + reduce (over D for the
  scores, over the tokens for the values), which XLA:CPU lowers to YNNPACK reductions: no
  transpose is materialised. Below `TOKEN_MIN_BATCH` rows it runs the head-major form (those
  reductions are slow at batch 1). On opt-125m it was at most ~5% faster than "xla" at batch 8
  and not faster at batch 16 (docs/performance.md), so it is not the default;
* `block_layout="heads"`: the pool's blocks stored head-major, `[num_blocks, H, block_size, D]`
  (or `[L, ...]`). With impl="xla" each chunk is gathered as [B, C, H, bs, D] and attended by two
  dots with (b, c, h) as batch dims: no transpose and no token-axis reduction (1.5-2.2x "xla" on
  token-major blocks for the attention alone, `scripts/bench_model.py --paged-layout-ab`). It is
  the serving pool's layout wherever impl="xla" or "xla_heads_flat" runs (`block_layout_for`, i.e. on CPU);
  "xla_gather" and "pallas_gpu" read it too, "xla_tokens" does not;
* `impl="xla_heads_flat"` (head-major blocks; on token-major ones it runs impl="xla"'s form, so a pool of
  either layout serves under the CPU default): the "heads" loop, but each gathered chunk
  [B, C, H, bs, D] is put [B, H, C*bs, D] (a transpose of the chunk, in cache) and attended by one dot per
  (b, h) over all C*bs positions instead of C dots of bs, at least `HEADS_FLAT_MIN_CHUNK_COLUMNS` columns a
  chunk (1.3-1.5x the attention at 16-64 rows over one column). The whole paged step, opt-125m, context 512, 2
  threads, interleaved, 5 reps, in both orders: 1.04-1.09x "xla" at batch 1-8, 1.00-1.04x at 16, 0.98-1.01x
  at 32 (`--paged-ab xla:heads,xla_heads_flat:heads`); end to end 1.04x and 1.06x (`--e2e-impls`). What
  serving runs on CPU (`default_impl`);
* `impl="cpu_kernel"` (head-major blocks, CPU backend): a C++ kernel (`models/kernels/paged_attention_cpu.cc`,
  an XLA FFI call built on first use by `models.kernels.cpu`) that reads each (row, K/V head)'s blocks in place
  from the pool, once for the K/V head's group of query heads, with no gather, no transpose and no per-(row,
  head) dot dispatch, items shared over XLA's intra-op threads. With `JAXSERVE_KERNEL_CHECKS=1` a checked
  build of it raises on an out-of-range block id / length instead of clamping it (`models.kernels.cpu`).
  Attention alone, opt-125m, 12 layers, 2 threads: 2-3.7x "xla_heads_flat" at 8-64 rows; GQA 3:1 and MQA
  read a third / a twelfth of MHA's K/V bytes and ran 2.1-3.6x / 5.2-9.1x faster than MHA (one layer, H=12,
  batch 8-32, context 512-2048, docs/performance.md "GQA attention"). What serving runs on CPU where the
  kernel builds (`default_impl`). Where it cannot be had (no compiler, a token-major pool, a dtype other than
  float32 / bfloat16 for q and the pages alike, `JAXSERVE_CPU_KERNEL=0`) it runs "xla_heads_flat"'s form. Its
  call is not partitioned: a stage split over several devices (tp > 1) runs "xla_heads_flat" instead
  (`ShardedOPT`);
* `impl="xla_gather"`: the previous form: gather every column of the table at once, transpose the
  whole context head-major, one softmax (kept as the plain reference and for A/B benchmarks);
* `impl="pallas_gpu"`: `jax.experimental.pallas.ops.gpu.paged_attention` (Triton), which reads
  the pages in place and wants them head-major `[H, num_blocks, block_size, D]`; the transpose
  here is a copy of the layer's pool, so this pays only where the gather would cost more.
  `interpret=True` runs the same kernel on CPU (slowly), which is how the tests check it.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from models.kernels import cpu as cpu_kernel

Impl = Literal["xla", "xla_tokens", "xla_gather", "pallas_gpu", "xla_heads_flat", "cpu_kernel"]
BlockLayout = Literal["tokens", "heads"]
BLOCK_LAYOUTS: tuple[BlockLayout, ...] = ("tokens", "heads")
_Form = Literal["transpose", "tokens", "heads", "heads_flat"]  # how impl="xla"'s chunk loop attends a chunk
IMPLS: tuple[Impl, ...] = ("xla", "xla_tokens", "xla_gather", "pallas_gpu", "xla_heads_flat", "cpu_kernel")
# The impls whose chunk loop serving runs over head-major blocks (`block_layout_for`; the profile's padding).
HEAD_MAJOR_LOOPS: tuple[Impl, ...] = ("xla", "xla_heads_flat")
_MASK_VALUE = -1e30
# Bytes of K (and again of V) that one loop iteration of impl="xla" gathers: the chunk is this many
# bytes' worth of table columns over the whole batch, at least one column. opt-125m, context 512, on
# 2 CPU cores under load, interleaved: batch 16 at 1 column (786 KB) per iteration 267 ms/step, 2
# columns 356, 4 columns 844; batch 1 at 1, 4 or 16 columns within noise (36-39 ms).
CHUNK_BYTES = 256 * 1024
# The same for impl="xla_tokens", rounded down to a power of two of columns: opt-125m attention alone
# (12 layers, context 512, loaded 2 cores, min ms): batch 8 at 1/2/4/8 columns 134/85/116/120, batch 16
# 156/137/106/185 (medians 255/218/232/307), so 2 columns (1.5 MB) at batch 8 and 16.
TOKEN_CHUNK_BYTES = 1024 * 1024
# The same for block_layout="heads": attention alone, opt-125m, batch 8 at 1/2/4/8 columns 47/42/38/39
# ms min, batch 16 83/74/74/79 (loaded 2 cores, interleaved), so 4 columns (3 MB) at batch 8.
HEADS_CHUNK_BYTES = 2 * 1024 * 1024
# ... and at most this many columns. At batch 1 the byte bound alone gives 32 columns, so a table bucketed to
# 32 columns or fewer (contexts up to 512 at block size 16) ran as one iteration over the whole table, and
# that ran the attention 2.4x slower than chunks of 4-8 columns (opt-125m, 12 layers, a 32-column table,
# 2 cores, interleaved min: 19.5-20.1 ms vs 7.8-8.1 ms); the whole paged step at batch 1, context 400: 34.0-35.4
# ms vs 40.0-42.9 (alternating runs). Batch 2 and 4, and batch 1 over a 128-column table, were the same at 8
# columns as at the byte bound's 16-32.
HEADS_MAX_CHUNK_COLUMNS = 8
# ... and for impl="xla_heads_flat" at least this many: its one dot per (b, h) runs over the chunk's C * bs
# positions, and at one column ([1 x 64] . [64 x 16] per head) the loop ran 1.3-1.5x slower than at four,
# which the byte bound above picks only up to batch 8. Attention alone, opt-125m, 12 layers, 2 threads,
# min ms of 5 interleaved, columns 1/2/4/8 (2026-12-02, load 1.4-1.7 from the run itself): batch 16 ctx 512
# 143/121/116/117, batch 32 302/219/210/225, batch 64 ctx 512 517/403/390/419, batch 64 ctx 192
# 225/153/151/268 (8 columns pad 12 filled ones to 16); batch 1-4 ctx 512 the same at 4 and 8.
HEADS_FLAT_MIN_CHUNK_COLUMNS = 4
# Below this batch impl="xla_tokens" runs the head-major form of impl="xla": at batch 1 XLA:CPU's
# reductions over the token axis ran at under 1 GB/s (attention alone 50 ms vs 10 ms head-major).
TOKEN_MIN_BATCH = 8


def paged_decode_attention(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [num_blocks, block_size, H, D], or [L, num_blocks, block_size, H, D] with `layer`
    v_pages: jax.Array,
    block_tables: jax.Array,  # [B, M] int32
    lengths: jax.Array,  # [B] int32: positions 0..lengths[b]-1 are attended
    *,
    scale: float,
    impl: Impl = "xla",
    interpret: bool = False,
    layer: Any = None,  # int or traced int32: index of the leading layer axis of the pool
    new_kv: tuple[jax.Array, jax.Array] | None = None,  # (k [B, KVH, D], v [B, KVH, D]): one more position per row
    chunk_blocks: int = 0,  # impl="xla": table columns per loop iteration (0: from CHUNK_BYTES)
    block_layout: BlockLayout = "tokens",  # "heads": pages are [..., num_blocks, H, block_size, D] (not "xla_tokens")
) -> jax.Array:
    """Softmax(q . k * scale) . v over each row's first `lengths[b]` paged positions (and `new_kv`) -> [B, H, D] f32."""
    if impl not in IMPLS:
        raise ValueError(f"unknown paged attention implementation {impl!r}")
    if block_layout not in BLOCK_LAYOUTS:
        raise ValueError(f"unknown block layout {block_layout!r}")
    if block_layout == "heads" and impl == "xla_tokens":
        raise ValueError("block_layout='heads' is not implemented for impl='xla_tokens' (a token-major form)")
    heads = block_layout == "heads"
    kv_heads = k_pages.shape[-3] if heads else k_pages.shape[-2]
    if q.shape[1] % kv_heads:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of the pool's {kv_heads} K/V heads")
    if impl == "cpu_kernel":  # any group size: the kernel reads each K/V head once for its group
        if heads and cpu_kernel_applies(q.dtype, k_pages.dtype, new_kv):
            return _cpu_kernel(q, k_pages, v_pages, block_tables, lengths, scale, layer, new_kv)
        impl = "xla_heads_flat"  # a token-major pool, another dtype, or no kernel here: the XLA loop
    if impl == "pallas_gpu":  # any group size: the kernel tiles a group's query heads against each page
        if new_kv is not None:
            raise ValueError("the Pallas kernel reads every position from the pages: write new_kv first")
        if layer is not None:
            k_pages, v_pages = k_pages[layer], v_pages[layer]
        return _pallas_gpu(q, k_pages, v_pages, block_tables, lengths, scale, interpret, heads)
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if q.shape[1] != kv_heads:  # grouped queries (GQA / MQA): q viewed [B, KVH, G, D], K/V never repeated
        if impl == "xla_gather":
            return _xla_gather_grouped(q, k_pages, v_pages, layer, block_tables, lengths, scale, new_kv, heads)
        return _xla_chunked_grouped(
            q, k_pages, v_pages, layer, block_tables, lengths, scale, new_kv, chunk_blocks, heads
        )
    if impl == "xla_gather":
        return _xla_gather(q, k_pages, v_pages, layer, block_tables, lengths, scale, new_kv, heads)
    tokens = impl == "xla_tokens" and q.shape[0] >= TOKEN_MIN_BATCH
    # the flat form is for head-major blocks; on token-major ones impl="xla_heads_flat" runs impl="xla"'s form
    form: _Form = (
        ("heads_flat" if impl == "xla_heads_flat" else "heads") if heads else "tokens" if tokens else "transpose"
    )
    return _xla_chunked(q, k_pages, v_pages, layer, block_tables, lengths, scale, new_kv, chunk_blocks, form)


def default_impl(wait: bool = True) -> Impl:
    """The implementation to use on the default backend.

    On CPU the C++ kernel "cpu_kernel" where it builds (`models.kernels.cpu`), else the chunked loop's
    one-dot-per-head form "xla_heads_flat" (the loop was measured on CPU only: it wins by keeping each chunk
    in cache; the flat form 1.04-1.09x "xla" at batch 1-8, docs/performance.md). On an accelerator each
    iteration is a handful of kernel launches, so the one-gather form stays the default there until an A/B
    on the device (`scripts/bench_model.py --paged-ab xla_gather,xla`) says otherwise.

    `wait=False` (a model being built, whose first paged step is seconds away): "cpu_kernel" while the kernel's
    build is still under way (`cpu_kernel.may_have_kernel`), which the step's trace then waits for; should that
    build fail, impl="cpu_kernel" runs the "xla_heads_flat" loop, on the same head-major pool.
    """
    if jax.default_backend() != "cpu":
        return "xla_gather"
    has_kernel = cpu_kernel.paged_attention_target() is not None if wait else cpu_kernel.may_have_kernel()
    return "cpu_kernel" if has_kernel else "xla_heads_flat"


def stage_impl(impl: Impl, devices: int) -> Impl:
    """The impl a stage over `devices` devices runs for `impl`: the kernel's call is not partitioned over
    heads, so a split stage runs "xla_heads_flat" in "cpu_kernel"'s place (`ShardedOPT`, the profile's padding)."""
    return "xla_heads_flat" if impl == "cpu_kernel" and devices > 1 else impl


def cpu_kernel_applies(q_dtype: Any, pages_dtype: Any, new_kv: tuple[jax.Array, jax.Array] | None = None) -> bool:
    """Whether impl="cpu_kernel" runs its kernel (not the XLA fallback) for these dtypes on this backend."""
    dtypes = {jnp.dtype(q_dtype), jnp.dtype(pages_dtype)} | ({jnp.dtype(x.dtype) for x in new_kv} if new_kv else set())
    return (
        jax.default_backend() == "cpu"
        and len(dtypes) == 1
        and dtypes <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}
        and cpu_kernel.paged_attention_target() is not None
    )


def block_layout_for(impl: Impl) -> BlockLayout:
    """The pool layout a deployment whose paged decode attention is `impl` stores its blocks in.

    "heads" for the chunked loop of "xla" (no transpose per chunk: 1.17x / 1.31x the whole paged
    step at batch 8 / 16 on CPU, docs/performance.md); "tokens" for the others: "xla_tokens" needs
    it, and "xla_gather" / "pallas_gpu" read either layout but were measured (on the GPU) on token-major blocks
    only. The dense KV that instances exchange is the same in both layouts, so the choice is each
    engine's own.
    """
    return "heads" if impl in (*HEAD_MAJOR_LOOPS, "cpu_kernel") else "tokens"


def _cpu_kernel(
    q: jax.Array,  # [B, H, D]
    k_pages: jax.Array,  # [N, H, bs, D], or [L, N, H, bs, D] with `layer`
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    layer: Any,
    new_kv: tuple[jax.Array, jax.Array] | None,
) -> jax.Array:
    """The C++ kernel over head-major blocks: the pool is passed whole and read in place at `layer`.

    q [B, H, D] against a pool of KVH heads (H a multiple of KVH); new_kv, if any, is [B, KVH, D].
    """
    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    if new_kv is not None:
        k_new, v_new = new_kv
    else:  # unread (has_new=False), but shaped as the kernel checks it
        k_new = v_new = jnp.zeros((q.shape[0], k_pages.shape[2], q.shape[2]), q.dtype)
    target = cpu_kernel.paged_attention_target()
    assert target is not None  # cpu_kernel_applies said so
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        k_pages,
        v_pages,
        block_tables.astype(jnp.int32),
        lengths.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32),
        k_new,
        v_new,
        scale=np.float32(scale),
        has_new=new_kv is not None,
    )


def _xla_gather(
    q: jax.Array,
    k_pages: jax.Array,  # [L, N, bs, H, D]
    v_pages: jax.Array,
    layer: Any,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    new_kv: tuple[jax.Array, jax.Array] | None,
    heads: bool = False,  # pages [L, N, H, bs, D]
) -> jax.Array:
    b, m = block_tables.shape
    if heads:  # gathered [B, M, H, bs, D] -> [B, H, M, bs, D] -> [B, H, S, D]
        _, _, h, bs, d = k_pages.shape
        keys = jnp.swapaxes(k_pages[layer, block_tables], 1, 2).reshape(b, h, m * bs, d)
        vals = jnp.swapaxes(v_pages[layer, block_tables], 1, 2).reshape(b, h, m * bs, d)
    else:
        _, _, bs, h, d = k_pages.shape
        keys = jnp.swapaxes(k_pages[layer, block_tables].reshape(b, m * bs, h, d), 1, 2)  # [B, H, S, D]
        vals = jnp.swapaxes(v_pages[layer, block_tables].reshape(b, m * bs, h, d), 1, 2)
    s = jnp.einsum("bhd,bhsd->bhs", q, keys, preferred_element_type=jnp.float32) * scale  # [B, H, S]
    s = jnp.where(jnp.arange(m * bs)[None, None, :] < lengths[:, None, None], s, _MASK_VALUE)
    if new_kv is None:
        p = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhs,bhsd->bhd", p.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    k_new, v_new = new_kv
    s_new = jnp.einsum("bhd,bhd->bh", q, k_new, preferred_element_type=jnp.float32)[..., None] * scale  # [B, H, 1]
    p = jax.nn.softmax(jnp.concatenate([s, s_new], axis=-1), axis=-1)
    out = jnp.einsum("bhs,bhsd->bhd", p[..., :-1].astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    return out + p[..., -1:] * v_new.astype(jnp.float32)


def _xla_gather_grouped(
    q: jax.Array,  # [B, H, D], H = KVH * G
    k_pages: jax.Array,  # [L, N, bs, KVH, D] (heads: [L, N, KVH, bs, D])
    v_pages: jax.Array,
    layer: Any,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    new_kv: tuple[jax.Array, jax.Array] | None,  # (k [B, KVH, D], v [B, KVH, D])
    heads: bool,
) -> jax.Array:
    """`_xla_gather` for G query heads per K/V head: q is viewed [B, KVH, G, D] and the group shares each K/V read."""
    b, m = block_tables.shape
    if heads:
        _, _, h, bs, d = k_pages.shape
        keys = jnp.swapaxes(k_pages[layer, block_tables], 1, 2).reshape(b, h, m * bs, d)  # [B, KVH, S, D]
        vals = jnp.swapaxes(v_pages[layer, block_tables], 1, 2).reshape(b, h, m * bs, d)
    else:
        _, _, bs, h, d = k_pages.shape
        keys = jnp.swapaxes(k_pages[layer, block_tables].reshape(b, m * bs, h, d), 1, 2)  # [B, KVH, S, D]
        vals = jnp.swapaxes(v_pages[layer, block_tables].reshape(b, m * bs, h, d), 1, 2)
    qg = q.reshape(b, h, -1, d)  # [B, KVH, G, D]: query head k * G + g reads K/V head k
    s = jnp.einsum("bkgd,bksd->bkgs", qg, keys, preferred_element_type=jnp.float32) * scale  # [B, KVH, G, S]
    s = jnp.where(jnp.arange(m * bs)[None, None, None, :] < lengths[:, None, None, None], s, _MASK_VALUE)
    if new_kv is not None:
        s_new = jnp.einsum("bkgd,bkd->bkg", qg, new_kv[0], preferred_element_type=jnp.float32)[..., None] * scale
        s = jnp.concatenate([s, s_new], axis=-1)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", p[..., : m * bs].astype(vals.dtype), vals, preferred_element_type=jnp.float32)
    if new_kv is not None:
        out = out + p[..., -1:] * new_kv[1].astype(jnp.float32)[:, :, None]
    return out.reshape(q.shape)


def _xla_chunked_grouped(
    q: jax.Array,  # [B, H, D], H = KVH * G
    k_pages: jax.Array,  # [L, N, bs, KVH, D] (heads: [L, N, KVH, bs, D])
    v_pages: jax.Array,
    layer: Any,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    new_kv: tuple[jax.Array, jax.Array] | None,  # (k [B, KVH, D], v [B, KVH, D])
    chunk_blocks: int,
    heads: bool,
) -> jax.Array:
    """`_xla_chunked` for G query heads per K/V head: each chunk's K/V [B, KVH, C*bs, D] is attended by the
    group's queries [B, KVH, G, D] in one product per (b, K/V head), with the online softmax carried per query head.

    Chunk widths follow "heads_flat" (head-major blocks) or "transpose" (token-major blocks) by K/V bytes.
    """
    b, m = block_tables.shape
    if heads:
        _, _, h, bs, d = k_pages.shape
    else:
        _, _, bs, h, d = k_pages.shape
    column_bytes = b * bs * h * d * k_pages.dtype.itemsize
    c = min(chunk_blocks or chunk_columns(column_bytes, "heads_flat" if heads else "transpose"), m)
    width = -(-m // c) * c
    tables = jnp.pad(block_tables, ((0, 0), (0, width - m))).reshape(b, width // c, c)  # [B, M/C, C]
    num_chunks = jnp.minimum((jnp.max(lengths) + c * bs - 1) // (c * bs), width // c)
    qg = q.reshape(b, h, -1, d)  # [B, KVH, G, D]: query head k * G + g reads K/V head k
    g = qg.shape[2]
    if new_kv is None:
        run_max = jnp.full((b, h, g), _MASK_VALUE, jnp.float32)
        run_sum = jnp.zeros((b, h, g), jnp.float32)
        acc = jnp.zeros((b, h, g, d), jnp.float32)
    else:
        k_new, v_new = new_kv
        run_max = jnp.einsum("bkgd,bkd->bkg", qg, k_new, preferred_element_type=jnp.float32) * scale
        run_sum = jnp.ones((b, h, g), jnp.float32)
        acc = jnp.broadcast_to(v_new.astype(jnp.float32)[:, :, None], (b, h, g, d))

    _Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]

    def body(carry: _Carry) -> _Carry:
        j, run_max, run_sum, acc = carry
        ids = jax.lax.dynamic_index_in_dim(tables, j, axis=1, keepdims=False)  # [B, C]
        pos = j * (c * bs) + jnp.arange(c * bs)
        if heads:  # [B, C, KVH, bs, D] -> [B, KVH, C*bs, D]
            keys = jnp.swapaxes(k_pages[layer, ids], 1, 2).reshape(b, h, c * bs, d)
            vals = jnp.swapaxes(v_pages[layer, ids], 1, 2).reshape(b, h, c * bs, d)
        else:  # [B, C*bs, KVH, D] -> [B, KVH, C*bs, D]
            keys = jnp.swapaxes(k_pages[layer, ids].reshape(b, c * bs, h, d), 1, 2)
            vals = jnp.swapaxes(v_pages[layer, ids].reshape(b, c * bs, h, d), 1, 2)
        s = jnp.einsum("bkgd,bksd->bkgs", qg, keys, preferred_element_type=jnp.float32) * scale  # [B, KVH, G, C*bs]
        s = jnp.where(pos[None, None, None, :] < lengths[:, None, None, None], s, _MASK_VALUE)
        new_max = jnp.maximum(run_max, jnp.max(s, axis=-1))
        rescale = jnp.exp(run_max - new_max)
        e = jnp.exp(s - new_max[..., None])
        weighted = jnp.einsum("bkgs,bksd->bkgd", e.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
        return j + 1, new_max, run_sum * rescale + jnp.sum(e, axis=-1), acc * rescale[..., None] + weighted

    init = (jnp.zeros((), jnp.int32), run_max, run_sum, acc)
    _, _, run_sum, acc = jax.lax.while_loop(lambda carry: carry[0] < num_chunks, body, init)
    return (acc / jnp.where(run_sum > 0, run_sum, 1.0)[..., None]).reshape(q.shape)


def chunk_columns(column_bytes: int, form: _Form) -> int:
    """Table columns one iteration of impl="xla"'s loop gathers by default (before the table's width caps it).

    `column_bytes`: K bytes of one table column over the whole batch. `form` "heads" (head-major pool
    blocks): the most columns within `HEADS_CHUNK_BYTES`, rounded down to a power of two, at most
    `HEADS_MAX_CHUNK_COLUMNS`; "heads_flat": the same but at least `HEADS_FLAT_MIN_CHUNK_COLUMNS`; "tokens":
    within `TOKEN_CHUNK_BYTES`, a power of two; "transpose": within `CHUNK_BYTES`. Always >= 1.
    `placement.padding.EnginePadding` mirrors this rule without JAX.
    """
    if form in ("heads", "heads_flat"):
        fits = 1 << max(0, (HEADS_CHUNK_BYTES // column_bytes).bit_length() - 1)
        if form == "heads_flat":
            fits = max(fits, HEADS_FLAT_MIN_CHUNK_COLUMNS)
        return min(fits, HEADS_MAX_CHUNK_COLUMNS)
    if form == "tokens":
        return 1 << max(0, (TOKEN_CHUNK_BYTES // column_bytes).bit_length() - 1)
    return max(1, CHUNK_BYTES // column_bytes)


def _xla_chunked(
    q: jax.Array,
    k_pages: jax.Array,  # [L, N, bs, H, D]
    v_pages: jax.Array,
    layer: Any,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    new_kv: tuple[jax.Array, jax.Array] | None,
    chunk_blocks: int,
    form: _Form,
) -> jax.Array:
    """The chunk loop. form: "transpose" gathers [B, C*bs, H, D] and puts it head-major for two dots;
    "tokens" attends it as gathered (multiply + reduce); "heads" gathers head-major blocks
    [B, C, H, bs, D] from a [L, N, H, bs, D] pool and runs both dots with (b, c, h) as batch dims."""
    b, m = block_tables.shape
    if form in ("heads", "heads_flat"):
        _, _, h, bs, d = k_pages.shape
    else:
        _, _, bs, h, d = k_pages.shape
    tokens = form == "tokens"
    column_bytes = b * bs * h * d * k_pages.dtype.itemsize  # one table column over the batch
    c = min(chunk_blocks or chunk_columns(column_bytes, form), m)
    width = -(-m // c) * c
    # padding columns name block 0: a valid block whose positions lie past every length (masked)
    tables = jnp.pad(block_tables, ((0, 0), (0, width - m))).reshape(b, width // c, c)  # [B, M/C, C]
    num_chunks = jnp.minimum((jnp.max(lengths) + c * bs - 1) // (c * bs), width // c)  # only filled chunks
    qf = q.astype(jnp.float32)

    if new_kv is None:  # start from an empty softmax
        run_max = jnp.full((b, h), _MASK_VALUE, jnp.float32)
        run_sum = jnp.zeros((b, h), jnp.float32)
        acc = jnp.zeros((b, h, d), jnp.float32)
    else:  # start from the softmax over the new position alone
        k_new, v_new = new_kv
        run_max = jnp.einsum("bhd,bhd->bh", qf, k_new.astype(jnp.float32)) * scale
        run_sum = jnp.ones((b, h), jnp.float32)
        acc = v_new.astype(jnp.float32)

    _Carry = tuple[jax.Array, jax.Array, jax.Array, jax.Array]  # (chunk, running max, running sum, weighted values)

    def body(carry: _Carry) -> _Carry:
        j, run_max, run_sum, acc = carry
        ids = jax.lax.dynamic_index_in_dim(tables, j, axis=1, keepdims=False)  # [B, C]
        pos = j * (c * bs) + jnp.arange(c * bs)
        if form == "heads":  # [B, C, H, bs, D]: batched dots over (b, c, h), no transpose of K or V
            kb = k_pages[layer, ids]
            vb = v_pages[layer, ids]
            sb = jnp.einsum("bchd,bchsd->bchs", jnp.broadcast_to(q[:, None], (b, c, h, d)), kb,
                            preferred_element_type=jnp.float32)  # fmt: skip
            s = jnp.swapaxes(sb, 1, 2).reshape(b, h, c * bs) * scale  # [B, H, C*bs] (small)
        elif tokens:  # [B, C*bs, H, D] as gathered; products as multiply + reduce over D and over S
            keys = k_pages[layer, ids].reshape(b, c * bs, h, d).astype(jnp.float32)
            vals = v_pages[layer, ids].reshape(b, c * bs, h, d).astype(jnp.float32)
            s = jnp.swapaxes(jnp.sum(keys * qf[:, None], axis=-1), 1, 2) * scale  # [B, H, C*bs] (small)
        else:
            if form == "heads_flat":  # [B, C, H, bs, D] -> [B, H, C, bs, D]: one dot per (b, h) over the chunk
                keys = jnp.swapaxes(k_pages[layer, ids], 1, 2).reshape(b, h, c * bs, d)
                vals = jnp.swapaxes(v_pages[layer, ids], 1, 2).reshape(b, h, c * bs, d)
            else:
                keys = jnp.swapaxes(k_pages[layer, ids].reshape(b, c * bs, h, d), 1, 2)  # [B, H, C*bs, D]
                vals = jnp.swapaxes(v_pages[layer, ids].reshape(b, c * bs, h, d), 1, 2)
            s = jnp.einsum("bhd,bhsd->bhs", q, keys, preferred_element_type=jnp.float32) * scale  # [B, H, C*bs]
        s = jnp.where(pos[None, None, :] < lengths[:, None, None], s, _MASK_VALUE)
        new_max = jnp.maximum(run_max, jnp.max(s, axis=-1))
        rescale = jnp.exp(run_max - new_max)  # [B, H]
        e = jnp.exp(s - new_max[..., None])  # masked positions: exp(-1e30 - max) == 0 once any score is real
        if form == "heads":
            eb = jnp.swapaxes(e.reshape(b, h, c, bs), 1, 2).astype(vb.dtype)  # [B, C, H, bs] (small)
            weighted = jnp.sum(jnp.einsum("bchs,bchsd->bchd", eb, vb, preferred_element_type=jnp.float32), axis=1)
        elif tokens:
            weighted = jnp.sum(jnp.swapaxes(e, 1, 2)[..., None] * vals, axis=1)  # [B, H, D]
        else:
            weighted = jnp.einsum("bhs,bhsd->bhd", e.astype(vals.dtype), vals, preferred_element_type=jnp.float32)
        acc = acc * rescale[..., None] + weighted
        return j + 1, new_max, run_sum * rescale + jnp.sum(e, axis=-1), acc

    init = (jnp.zeros((), jnp.int32), run_max, run_sum, acc)
    _, _, run_sum, acc = jax.lax.while_loop(lambda carry: carry[0] < num_chunks, body, init)
    return acc / jnp.where(run_sum > 0, run_sum, 1.0)[..., None]  # 0 only when nothing at all was attended


def _pallas_gpu(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_tables: jax.Array,
    lengths: jax.Array,
    scale: float,
    interpret: bool,
    heads: bool = False,  # pages [N, H, bs, D]
) -> jax.Array:
    from jax.experimental.pallas.ops.gpu import paged_attention as kernel

    interpret = interpret or jax.default_backend() == "cpu"  # the Triton kernel runs on CPU only interpreted
    m = block_tables.shape[1]
    k_splits = min(16, m)
    if m % k_splits:
        raise ValueError(f"table width {m} must be a multiple of {k_splits} for the Pallas kernel")
    perm = (1, 0, 2, 3) if heads else (2, 0, 1, 3)
    kh = jnp.transpose(k_pages, perm)  # [H, N, bs, D]
    vh = jnp.transpose(v_pages, perm)
    out = kernel.paged_attention(
        (q * scale).astype(k_pages.dtype),  # the kernel does not scale q . k
        kh,
        vh,
        block_tables,
        lengths,
        k_splits=k_splits,
        pages_per_compute_block=max(1, min(8, m // k_splits)),
        interpret=interpret,
    )
    return out.astype(jnp.float32)
