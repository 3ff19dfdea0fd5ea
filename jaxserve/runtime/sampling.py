"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

`token_logprobs` computes, on the device and only for a batch in which some row asked, each sampled
token's log-probability and the `MAX_LOGPROBS` most likely tokens (one static K, so the number a
request asks for never compiles a new program); `logprobs_rows` turns them into `TokenLogprobs`
on the host, cut to what each row asked. They are the log-softmax of the raw logits, before
temperature / top-k / top-p (vLLM's default "raw logprobs").

Each row's noise is a hash of its seed, its sample index and the token id (`_gumbel`), so a
request's tokens depend only on its seed and position in its output, never on
which other requests share the batch or where in the batch it sits. That is what
lets an engine sample a batch on more rows than it has (`pad_rows`: zero logits,
sampled greedily, read by no one) while the sampler of its own row count is still
compiling on a background thread: its rows draw the tokens they would alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.request import MAX_LOGPROBS, SamplingParams, TokenLogprobs


def default_seed(request_id: str) -> int:
    """The seed of a request that gave none: a stable hash of its id."""
    return zlib.crc32(request_id.encode())


def argmax_rows(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32 (the first of equal maxima), in two vectorised passes (a max, then the
    least index holding it): XLA:CPU's variadic argmax reduction runs ~3x slower over a 49k vocabulary. A row
    with a NaN (a broken model) gives its last index, never one out of range."""
    top = jnp.max(x, axis=-1, keepdims=True)
    ids = jnp.arange(x.shape[-1], dtype=jnp.int32)
    return jnp.minimum(jnp.min(jnp.where(x == top, ids, x.shape[-1]), axis=-1), x.shape[-1] - 1)


@jax.jit
def _greedy(logits: jax.Array) -> jax.Array:
    return argmax_rows(logits)  # [B]


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: each input bit flips about half of the output bits."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gumbel(seed_hi: jax.Array, seed_lo: jax.Array, index: jax.Array, vocab: int) -> jax.Array:
    """Gumbel noise [B, V], a pure function of each row's (seed, sample index) and the token id.

    A counter hash (two 32-bit key words per row, two finaliser rounds per token) rather than a PRNG stream:
    it lowers to a dozen integer ops, where threefry's draw of V uniforms lowered to hundreds and ran ~5x
    slower on CPU. Uniforms of 24 bits bound the noise, so a token more than ~20 nats below the most likely
    one (a probability ratio under ~2e-9) is never drawn."""
    k1 = _mix(_mix(seed_lo ^ jnp.uint32(0x9E3779B9)) ^ seed_hi)
    k2 = _mix(k1 ^ _mix(index + jnp.uint32(0x7F4A7C15)))
    token = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    bits = _mix(_mix((token * jnp.uint32(0x9E3779B1)) ^ k1[:, None]) ^ k2[:, None])
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * jnp.float32(2.0**-24)  # in (0, 1)
    return -jnp.log(-jnp.log(u))


def _order_key(x: jax.Array) -> jax.Array:
    """uint32 keys that order as the float32 values `x` do (sign bit set for positives, all bits flipped
    for negatives)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_key(enough: Callable[[jax.Array], jax.Array], rows: int) -> jax.Array:
    """Per row, the largest uint32 `s` for which `enough(s)` ([B, 1] -> [B] bool) holds, built bit by bit from
    the top (32 passes); `enough` must be monotone (true up to some `s`, false above); 0 where it never holds."""

    def bit(i: jax.Array, s: jax.Array) -> jax.Array:
        trial = s | (jnp.uint32(1) << (jnp.uint32(31) - i.astype(jnp.uint32)))
        return jnp.where(enough(trial[:, None]), trial, s)

    return jax.lax.fori_loop(0, 32, bit, jnp.zeros((rows,), jnp.uint32))


def _top_k_cut(keys: jax.Array, top_k: jax.Array) -> jax.Array:
    """[B] uint32: the key of each row's `top_k`-th largest value (0, keeping all, where top_k is 0)."""
    kth = _largest_key(lambda s: jnp.sum(keys >= s, axis=-1) >= top_k, keys.shape[0])
    return jnp.where(top_k > 0, kth, jnp.uint32(0))


def _top_p_cut(keys: jax.Array, scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B] uint32: the key of the least likely token of each row's nucleus (the most likely tokens down to the
    first at which their mass reaches `top_p`, that one included) over the tokens `scaled` still holds
    (-inf: cut); 0, keeping all, where top_p is 1."""
    probs = jax.nn.softmax(scaled, axis=-1)
    cut = _largest_key(lambda s: jnp.sum(jnp.where(keys >= s, probs, 0.0), axis=-1) >= top_p, keys.shape[0])
    return jnp.where(top_p < 1.0, cut, jnp.uint32(0))


@jax.jit
def _sample_batch(
    logits: jax.Array,  # [B, V]
    temperature: jax.Array,  # [B]
    top_k: jax.Array,
    top_p: jax.Array,
    seed_hi: jax.Array,
    seed_lo: jax.Array,
    index: jax.Array,
) -> jax.Array:
    """One token per row: the argmax where temperature is 0, else a draw from softmax(logits / temperature) cut
    to its top-k, then to the top-p of what is left: Gumbel-max over the kept tokens.

    No sort: each cut is a threshold on the values, found by bisection over their bits (32 counting passes),
    which XLA:CPU runs ~10x faster than it sorts a 49k vocabulary, and a batch in which no row asks for a cut
    skips it. Tokens tied at a cut are all kept."""
    vocab = logits.shape[-1]
    greedy = temperature == 0.0
    scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, jnp.maximum(temperature, 1e-6))[:, None]
    keys = _order_key(scaled)
    top_k = jnp.where(greedy, 0, top_k)
    top_p = jnp.where(greedy, 1.0, top_p)
    none = jnp.zeros(top_k.shape, jnp.uint32)
    k_cut = jax.lax.cond(jnp.any(top_k > 0), _top_k_cut, lambda *_: none, keys, top_k)
    scaled = jnp.where(keys >= k_cut[:, None], scaled, -jnp.inf)
    p_cut = jax.lax.cond(jnp.any(top_p < 1.0), _top_p_cut, lambda *_: none, keys, scaled, top_p)
    noise = jnp.where(greedy[:, None], 0.0, _gumbel(seed_hi, seed_lo, index, vocab))
    return argmax_rows(jnp.where(keys >= p_cut[:, None], scaled + noise, -jnp.inf))


@partial(jax.jit, static_argnames=("rows",))
def pad_rows(logits: jax.Array, rows: int) -> jax.Array:
    """`logits` [B, V] with zero rows appended up to `rows` -> [rows, V] (`sample` draws them greedily)."""
    return jnp.pad(logits, ((0, rows - logits.shape[0]), (0, 0)))


class SamplingInputs(NamedTuple):
    """Per-row sampling parameters as arrays [B] (padding rows greedy), ready to go to the device."""

    temperature: np.ndarray  # float32
    top_k: np.ndarray  # int32
    top_p: np.ndarray  # float32
    seed_hi: np.ndarray  # uint32
    seed_lo: np.ndarray  # uint32
    sample_index: np.ndarray  # uint32: each row's sample index (its position in its output)


def sampling_inputs(
    params: Sequence[SamplingParams], seeds: Sequence[int], indices: Sequence[int], batch: int
) -> SamplingInputs:
    pad = batch - len(params)
    seeds_arr = np.array(list(seeds) + [0] * pad, dtype=np.uint64)
    return SamplingInputs(
        temperature=np.array([p.temperature for p in params] + [0.0] * pad, dtype=np.float32),
        top_k=np.array([p.top_k for p in params] + [0] * pad, dtype=np.int32),
        top_p=np.array([p.top_p for p in params] + [1.0] * pad, dtype=np.float32),
        seed_hi=(seeds_arr >> np.uint64(32)).astype(np.uint32),
        seed_lo=(seeds_arr & np.uint64(0xFFFFFFFF)).astype(np.uint32),
        sample_index=np.array(list(indices) + [0] * pad, dtype=np.uint32),
    )


def sample_traced(logits: jax.Array, inputs: SamplingInputs, offset: jax.Array | int = 0) -> jax.Array:
    """`sample` inside a traced program: row b draws its sample `inputs.index[b] + offset`. -> [B] int32."""
    index = jnp.asarray(inputs.sample_index) + jnp.asarray(offset, jnp.uint32)
    return _sample_batch(logits, inputs.temperature, inputs.top_k, inputs.top_p, inputs.seed_hi, inputs.seed_lo, index)


def sample(
    logits: jax.Array, params: Sequence[SamplingParams], seeds: Sequence[int], indices: Sequence[int]
) -> jax.Array:
    """One token per row of `logits` [B, V]; rows past len(params) (padding) are sampled greedily.

    Returns a device array [B] (int32).
    """
    if all(p.is_greedy for p in params):
        return _greedy(logits)
    return _sample_batch(logits, *sampling_inputs(params, seeds, indices, logits.shape[0]))


class StepLogprobs(NamedTuple):
    """Device arrays of one step's logprobs: the sampled tokens' and the top `MAX_LOGPROBS` per row."""

    chosen: jax.Array  # [B] float32
    top_ids: jax.Array  # [B, MAX_LOGPROBS] int32, most likely first
    top_logprobs: jax.Array  # [B, MAX_LOGPROBS] float32


def token_logprobs_traced(logits: jax.Array, tokens: jax.Array) -> StepLogprobs:
    """Log-softmax of `logits` [B, V] (float32): each row's `tokens` [B] entry and its top `MAX_LOGPROBS`."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, V]
    chosen = jnp.take_along_axis(logp, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]  # [B]
    top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logits.shape[-1]))  # [B, K]
    return StepLogprobs(chosen, top_ids.astype(jnp.int32), top_lp)


token_logprobs = jax.jit(token_logprobs_traced)


def logprobs_rows(
    chosen: np.ndarray, top_ids: np.ndarray, top_logprobs: np.ndarray, params: Sequence[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Host arrays [B], [B, K], [B, K] -> one `TokenLogprobs` per row of `params` that asked (else None)."""
    out: list[TokenLogprobs | None] = []
    for r, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        k = p.logprobs
        top = tuple((int(i), float(v)) for i, v in zip(top_ids[r, :k], top_logprobs[r, :k], strict=True))
        out.append(TokenLogprobs(float(chosen[r]), top))
    return out
