"""ModelEngine warm-up (every bucket the limits allow), KV pool sizing, persistent compilation cache."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.core.errors import InvalidRequestError
from jaxserve.core.request import MAX_STOP_TOKEN_IDS, SamplingParams
from jaxserve.runtime.compilation.background import CompileJob
from jaxserve.runtime.compilation.cache import enable_compilation_cache
from jaxserve.runtime.engines.contract import KVPages, PrefillItem, StepBatch, StepRow, WarmupSpec
from jaxserve.runtime.engines.model import ModelEngine, _host_available_bytes
from models.sharding import ShardedOPT

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def engine() -> ModelEngine:
    return ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[:1]))


def _paged_cache_size(engine: ModelEngine) -> int:
    return sum(fn._cache_size() for key, fn in engine.model._fns.items() if key[0] == "paged")  # type: ignore[attr-defined]


def test_warmup_compiles_every_bucket_and_serving_then_compiles_nothing(engine: ModelEngine) -> None:
    report = engine.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_decode_batch=4, max_batch_tokens=32, max_seq_len=16, chunk_size=16)
    )
    # prefill: 16-token prompts; rows up to 32, since 32 one-token prompts fit the 32-token cap (the
    # smallest batch of each row bucket, rows/2 + 1 prompts, must fit); decode: rows {2, 4} x widths
    # {1, 2, 4}; prompt rows of a colocated step: the 16-token budget split over 1, 2 or 4 prompts
    assert report.prefill_shapes == ((1, 16), (2, 16), (4, 16), (8, 16), (16, 16), (32, 16))
    assert report.step_shapes == (
        (2, 1, 1), (2, 1, 2), (2, 1, 4), (4, 1, 1), (4, 1, 2), (4, 1, 4),
        (1, 16, 1), (1, 16, 2), (1, 16, 4), (2, 16, 1), (2, 16, 2), (2, 16, 4), (4, 16, 1), (4, 16, 2), (4, 16, 4),
    )  # fmt: skip
    assert report.num_programs == 21 and report.seconds > 0
    compiled = _paged_cache_size(engine)
    pages = engine.init_pages(8, 4)
    rows = tuple(StepRow(f"r{i}", (5,), 6, (i, 4 + i), GREEDY, 0, 0) for i in range(3))  # 3 rows -> 4, width 2
    _, pages = engine.decode_step(StepBatch(rows), pages)
    assert _paged_cache_size(engine) == compiled


def test_warmup_on_a_pool_returns_it(engine: ModelEngine) -> None:
    pages = engine.init_pages(8, 4)
    report = engine.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_decode_batch=2, max_seq_len=4, prefill=False), pages
    )
    assert report.step_shapes == ((2, 1, 1),)
    assert report.pages is not None and report.pages[0].k.shape == pages[0].k.shape


def test_kv_block_bytes_is_exact(engine: ModelEngine) -> None:
    # opt-tiny: 2 layers x 4 heads x 16 head dims, K and V, float32
    assert engine.kv_block_bytes(16) == 2 * 2 * 16 * 4 * 16 * 4
    tp2 = ModelEngine(ShardedOPT.load("opt-tiny", tp=2, pp=1, devices=jax.devices()[:2]))
    assert tp2.kv_block_bytes(16) == 2 * 2 * 16 * 2 * 16 * 4  # heads split over tp


def test_kv_blocks_for_memory_on_cpu_uses_a_share_of_available_host_memory(
    engine: ModelEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    share = 1 / len(jax.devices("cpu"))
    monkeypatch.setenv("JAXSERVE_CPU_KV_SPACE_GIB", "1")  # the CPU cap: 1 GiB over all devices
    assert engine.kv_blocks_for_memory(16, memory_fraction=0.5) == int(2**30 * share // engine.kv_block_bytes(16))
    monkeypatch.setenv("JAXSERVE_CPU_KV_SPACE_GIB", "100000")  # no cap: the share of available memory
    expected = 0.5 * _host_available_bytes() * share / engine.kv_block_bytes(16)
    got = engine.kv_blocks_for_memory(16, memory_fraction=0.5)
    assert abs(got - expected) / expected < 0.05  # MemAvailable moves a little between the two reads
    assert engine.kv_blocks_for_memory(16, memory_fraction=0.5, max_blocks=300) == 300
    # tp=2: each device holds half of every block, so twice the blocks fit in the same per-device share
    tp2 = ModelEngine(ShardedOPT.load("opt-tiny", tp=2, pp=1, devices=jax.devices()[:2]))
    assert abs(tp2.kv_blocks_for_memory(16, memory_fraction=0.5) - 2 * expected) / (2 * expected) < 0.05
    with pytest.raises(ValueError, match="memory_fraction"):
        engine.kv_blocks_for_memory(16, memory_fraction=0.0)


def test_enable_compilation_cache_sets_the_directory(tmp_path: Path) -> None:
    before = jax.config.jax_compilation_cache_dir
    try:
        path = enable_compilation_cache(tmp_path / "xla")
        assert path == (tmp_path / "xla").absolute() and path.is_dir()
        assert jax.config.jax_compilation_cache_dir == str(path)
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_background_warmup_serves_every_shape_padded_up_and_never_compiles_on_the_step_path() -> None:
    """`warmup` with `background`: only the frontier buckets compile before it returns; every other bucket's work
    runs padded up to a compiled one (same greedy tokens as its own bucket) while the rest compile aside; once
    they are in, each runs its own bucket. The jitted paged step never compiles on the step path."""
    model = ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[1:2])
    eng = ModelEngine(model)
    plain = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[2:3]))
    report = eng.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_decode_batch=4, max_batch_tokens=32, max_seq_len=16, background=True)
    )
    eng.stop_background_warmup()  # covering alone first: whatever the thread had not compiled stays padded up
    # the buckets holding all others of area <= 2 x the budget, and a lone prompt's / a lone stream's own
    assert report.prefill_shapes == ((4, 16), (1, 16)) and report.step_shapes == ((4, 1, 4), (2, 1, 4))
    compiled = _paged_cache_size(eng)

    def run(engine: ModelEngine) -> list[int]:
        pages = engine.init_pages(8, 4)
        prefilled = engine.prefill([PrefillItem("p", (5, 6, 7), GREEDY, 0)]).sequences[0]
        pages = engine.insert(prefilled.kv, 3, pages, [0, 1])
        out, tok = [prefilled.first_token], prefilled.first_token
        for k in range(3):
            (tok,), pages = engine.decode_step(StepBatch((StepRow("p", (tok,), 3 + k, (0, 1), GREEDY, 0, k),)), pages)
            out.append(tok)
        return out

    assert eng.step_shape([StepRow("p", (5,), 3, (0, 1), GREEDY, 0, 0)], 4) == (2, 1, 4)  # padded to full width
    assert run(eng) == run(plain)
    assert _paged_cache_size(eng) == compiled  # padded up: nothing compiled on the step path
    eng.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_decode_batch=4, max_batch_tokens=32, max_seq_len=16, background=True)
    )
    assert eng.background_warmup_done(timeout_s=300)
    assert (2, 1, 1) in eng.compilation.ready_steps and {(1, 16), (32, 16)} <= eng.compilation.ready_prefill
    assert eng.step_shape([StepRow("p", (5,), 3, (0, 1), GREEDY, 0, 0)], 4) == (2, 1, 1)  # its own bucket now
    assert run(eng) == run(plain)
    assert _paged_cache_size(eng) == compiled  # the precompiled executables ran, not the jitted step


class _CompileLog(logging.Handler):
    """JAX's compile log (`jax_log_compiles`): one line per program XLA compiles, on any thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "Compiling" in record.getMessage():
            self.lines.append(record.getMessage())


@contextlib.contextmanager
def _compiles() -> Iterator[list[str]]:
    handler, logger = _CompileLog(), logging.getLogger("jax")
    logger.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        jax.jit(lambda x: x * 5 - 2)(jax.numpy.ones(11)).block_until_ready()  # the witness sees a compile
        assert handler.lines, "jax_log_compiles logged nothing for a fresh program: the check would be blind"
        handler.lines.clear()
        yield handler.lines
    finally:
        jax.config.update("jax_log_compiles", False)
        logger.removeHandler(handler)


@pytest.mark.slow  # ~9 s: every program of the test compiles anew (jax.clear_caches)
def test_random_sampling_right_after_a_background_warmup_compiles_nothing_and_draws_the_same_tokens() -> None:
    """`warmup` with `background` compiles the random sampler of one row count only (the most rows of a foreground
    bucket); until the background has compiled a lone prompt's and a lone stream's own, their random draws run on
    logits padded up to it: nothing compiles on the request path, and the seeded tokens are those an engine
    sampling on its own row count draws."""
    jax.clear_caches()  # no sampler of this process (another test's) may stand in for the ones under test
    eng = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[3:4]))
    plain = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[4:5]))
    eng.hold_background_warmup()  # the background jobs wait: the foreground's programs alone
    report = eng.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_decode_batch=4, max_batch_tokens=32, max_seq_len=16, background=True)
    )
    assert report.prefill_shapes == ((4, 16), (1, 16)) and report.step_shapes == ((4, 1, 4), (2, 1, 4))
    assert eng.compilation.ready_random == {
        4
    }  # the lone prompt's (1 row) and the lone stream's (2 rows) are not compiled

    def run(engine: ModelEngine, pages: KVPages) -> list[int]:
        hot = SamplingParams(temperature=1.0, top_p=0.9, seed=11)
        prefilled = engine.prefill([PrefillItem("p", (5, 6, 7), hot, 11)]).sequences[0]
        pages = engine.insert(prefilled.kv, 3, pages, [0, 1])
        out, tok = [prefilled.first_token], prefilled.first_token
        for k in range(4):
            row = StepRow("p", (tok,), 3 + k, (0, 1), hot, 11, k + 1)
            (tok,), pages = engine.decode_step(StepBatch((row,)), pages)
            out.append(tok)
        return out

    want = run(plain, plain.init_pages(8, 4))
    pages = eng.init_pages(8, 4)  # an instance's pool, made once before its first request
    with _compiles() as lines:
        assert run(eng, pages) == want
    assert lines == [], f"{len(lines)} compilations on the request path, first: {lines[:2]}"
    eng.start_background_warmup()  # its first jobs: those two samplers; stopped once they are in
    while not {1, 2} <= eng.compilation.ready_random and not eng.background_warmup_done(timeout_s=0.05):
        pass
    eng.stop_background_warmup()
    assert {1, 2} <= eng.compilation.ready_random
    pages = eng.init_pages(8, 4)  # the first run's was donated to its steps
    with _compiles() as lines:
        assert run(eng, pages) == want
    assert lines == [], f"{len(lines)} compilations on the request path, first: {lines[:2]}"


def test_a_batch_no_compiled_bucket_holds_runs_as_held_sub_batches_and_compiles_nothing() -> None:
    """Right after `warmup` with `background` (the background jobs held: the foreground's programs alone), a prefill
    batch whose own bucket (4 rows x 32 tokens) no compiled bucket holds (2 x 32 and 4 x 16 are in) runs as
    consecutive sub-batches each held by one, instead of compiling its own: nothing compiles on the request path,
    and every prompt's first token and KV length are those of an engine prefilling the batch in its own bucket."""
    eng = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[5:6]))
    plain = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[6:7]))
    eng.hold_background_warmup()
    report = eng.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_batch_tokens=32, max_seq_len=32, decode=False, background=True)
    )
    assert set(report.prefill_shapes) == {(4, 16), (2, 32), (1, 32)}
    hot = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    prompts = [tuple(range(4, 21)), (7, 8, 9), (10, 11, 12), (13, 14, 15)]  # 17 + 3 x 3 tokens: bucket (4, 32)
    items = [PrefillItem(f"r{i}", p, hot if i == 1 else GREEDY, 3 if i == 1 else 0) for i, p in enumerate(prompts)]
    want = plain.prefill(items).sequences
    with _compiles() as lines:
        got = eng.prefill(items).sequences
    assert lines == [], f"{len(lines)} compilations on the request path, first: {lines[:2]}"
    assert [s.request_id for s in got] == ["r0", "r1", "r2", "r3"]
    assert [s.first_token for s in got] == [s.first_token for s in want]
    assert [s.kv[0].k.shape for s in got] == [s.kv[0].k.shape for s in want]


def test_a_row_is_cut_through_each_shorter_length_until_its_direct_cut_is_in_and_compiles_nothing() -> None:
    """Right after `warmup` with `background` (the background jobs held), a prefill batch's short row is cut to its
    own padded length through each shorter length in turn (64 -> 32 -> 16): the foreground compiled one cut per
    length, not one per pair. Nothing compiles on the request path, and every row's KV is the one an engine
    prefilling the batch on its own holds. Once the background has compiled the direct cut (64 -> 16), it is in."""
    eng = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[5:6]))
    plain = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[6:7]))
    eng.hold_background_warmup()
    eng.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_batch_tokens=64, max_seq_len=64, decode=False, background=True)
    )
    assert {(64, 32), (32, 16)} <= eng.compilation.ready_slices and (64, 16) not in eng.compilation.ready_slices
    prompts = [tuple(range(4, 44)), (7, 8, 9)]  # 40 and 3 tokens: one batch of 64 positions; rows of 64 and 16
    items = [PrefillItem(f"r{i}", p, GREEDY, 0) for i, p in enumerate(prompts)]
    with _compiles() as lines:  # first: the reference engine's own cut would compile that program for this one
        got = eng.prefill(items).sequences
    assert lines == [], f"{len(lines)} compilations on the request path, first: {lines[:2]}"
    want = plain.prefill(items).sequences
    assert [s.kv[0].k.shape[1] for s in got] == [64, 16]
    for g, w in zip(got, want, strict=True):
        assert g.first_token == w.first_token
        np.testing.assert_array_equal(np.asarray(g.kv[0].k), np.asarray(w.kv[0].k))
        np.testing.assert_array_equal(np.asarray(g.kv[0].v), np.asarray(w.kv[0].v))
    eng.start_background_warmup()
    assert eng.background_warmup_done(timeout_s=300)
    assert (64, 16) in eng.compilation.ready_slices


_READY_SETS = (
    "ready_prefill",
    "ready_steps",
    "ready_random",
    "ready_pads",
    "ready_slices",
    "ready_inserts",
    "ready_gathers",
)


@pytest.mark.slow  # 7-20 s on a loaded 2-core box (alone: 20 s): a foreground warm-up, then three background compiles
def test_a_background_job_publishes_nothing_while_it_compiles_and_its_program_once_published(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every `CompileJob` a `warmup` with `background` hands to the thread leaves the engine's ready sets as they
    were while it compiles (the serving side must not take a program before its job is done), and its publish
    puts its program in: the random sampler's row count, the prefill or step bucket."""
    eng = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[7:8]))
    jobs: list[CompileJob] = []
    monkeypatch.setattr(eng.compilation, "_start_background", jobs.extend)  # the jobs themselves, run here in order
    eng.warmup(
        WarmupSpec(
            num_blocks=8,
            block_size=8,
            max_decode_batch=2,
            max_batch_tokens=16,
            max_seq_len=16,
            max_prefill_rows=4,
            background=True,
        )
    )
    assert [j.what for j in jobs] == ["random sampler (1 rows)", "prefill (4, 16)", "step (2, 1, 1)"]
    published: list[dict[str, set[object]]] = []
    for job in jobs:
        before = {name: getattr(eng.compilation, name) for name in _READY_SETS}
        job.compile()
        assert {name: getattr(eng.compilation, name) for name in _READY_SETS} == before, (
            f"{job.what} published in compile"
        )
        job.publish()
        gained = {name: set(getattr(eng.compilation, name) - before[name]) for name in _READY_SETS}
        published.append({name: new for name, new in gained.items() if new})
    assert published == [
        {"ready_random": {1}},
        {"ready_random": {4}, "ready_prefill": {(4, 16)}},  # the bucket with its rows' random sampler
        {"ready_steps": {(2, 1, 1)}},  # two rows' random sampler was in before (the foreground's steps)
    ]


def test_multi_step_programs_hold_every_stop_id_count_a_request_may_send_and_compile_nothing_after_warmup() -> None:
    """A multi-step program checks each row's stop ids on the device at one padded width: the model's EOS ids plus
    the most stop ids a request may name (`MAX_STOP_TOKEN_IDS`). A client that varies the count (0, 5, 64 ids,
    EOS honoured or ignored) runs the warmed program every time: no compile on the request path. One more id than
    the limit is refused by the request's own checks, before any engine sees it."""
    eng = ModelEngine(ShardedOPT.load("opt-tiny", tp=1, pp=1, devices=jax.devices()[:1]))
    pages = eng.init_pages(8, 4)
    report = eng.warmup(
        WarmupSpec(num_blocks=8, block_size=4, max_decode_batch=2, max_seq_len=8, prefill=False, decode_steps=3),
        pages,
    )
    assert report.pages is not None
    pages = report.pages
    counts = (0, 5, MAX_STOP_TOKEN_IDS)
    with _compiles() as compiled:
        for n, ignore_eos in itertools.product(counts, (False, True)):
            stops = tuple(range(1000, 1000 + n))  # ids the random model is not going to draw in 3 steps
            sampling = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=stops, ignore_eos=ignore_eos)
            rows = (StepRow("a", (5,), 1, (0,), sampling, 0, 1), StepRow("b", (7,), 2, (1,), GREEDY, 0, 1))
            _, pages = eng.decode_steps(StepBatch(rows), pages, num_steps=3)
    assert compiled == []
    too_many = SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))
    with pytest.raises(InvalidRequestError, match=f"at most {MAX_STOP_TOKEN_IDS} stop token ids"):
        too_many.check_ranges(max_tokens_limit=16)
