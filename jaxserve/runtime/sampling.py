"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seed.

`token_logprobs` computes, on the device and only for a batch in which some row asked, each sampled
token's log-probability and the `MAX_LOGPROBS` most likely tokens (one static K, so the number a
request asks for never compiles a new program); `logprobs_rows` turns them into `TokenLogprobs`
on the host, cut to what each row asked. They are the log-softmax of the raw logits, before
temperature / top-k / top-p (vLLM's default "raw logprobs").

Each row draws from its own key, `fold_in(key(seed), sample_index)`, so a
request's tokens depend only on its seed and position in its output, never on
which other requests share the batch or where in the batch it sits. That is what
lets an engine sample a batch on more rows than it has (`pad_rows`: zero logits,
sampled greedily, read by no one) while the sampler of its own row count is still
compiling on a background thread: its rows draw the tokens they would alone.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.request import MAX_LOGPROBS, SamplingParams, TokenLogprobs


def default_seed(request_id: str) -> int:
    """The seed of a request that gave none: a stable hash of its id."""
    return zlib.crc32(request_id.encode())


@jax.jit
def _greedy(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B]


def _row_key(seed_hi: jax.Array, seed_lo: jax.Array, index: jax.Array) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed_hi), seed_lo)
    return jax.random.fold_in(key, index)


def _sample_row(
    logits: jax.Array,  # [V]
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seed_hi: jax.Array,
    seed_lo: jax.Array,
    index: jax.Array,
) -> jax.Array:
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-6)
    order = jnp.argsort(-scaled)  # [V] descending
    sorted_logits = scaled[order]
    rank = jnp.arange(vocab)
    keep = jnp.where(top_k > 0, rank < top_k, True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf))
    before = jnp.cumsum(probs) - probs  # mass strictly above this token
    keep = keep & ((before < top_p) | (rank == 0))
    choice = jax.random.categorical(_row_key(seed_hi, seed_lo, index), jnp.where(keep, sorted_logits, -jnp.inf))
    sampled = order[choice]
    return jnp.where(temperature == 0.0, jnp.argmax(logits), sampled).astype(jnp.int32)


_sample_batch = jax.jit(jax.vmap(_sample_row))


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
