"""Models serving quantized weights (`models.quantize`): a GGUF served as stored against transformers reading
the same file, tp / pp splits, int8 / int4 of a float checkpoint against the float model, and the refusals.

The GGUF files are written by tests/test_gguf.py's `write_gguf` (the `gguf` package's own quantizer; K-quants
as hand-built blocks). transformers dequantizes the file itself, so it is an independent reference for what
the served (never dequantized) weights must compute: logits within fp32 rounding, the same greedy tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from test_gguf import PROMPT, _hf_from_gguf, _hf_model, write_gguf  # noqa: E402

from jaxserve.assets import DEFAULT_MODEL_DIR  # noqa: E402
from models import checkpoint  # noqa: E402
from models.quant import QuantFormatError, QuantizedWeight  # noqa: E402
from models.quantize import QuantizationError, check_quantization  # noqa: E402
from models.sharding import ShardedLlama, ShardedModel, sharded_class  # noqa: E402

Q = gguf.GGMLQuantizationType


def _greedy(model: ShardedModel, prompt: np.ndarray, num_new: int) -> list[int]:
    """Prefill, then contiguous-cache decode steps of a sharded model; greedy."""
    logits, kv = model.prefill(prompt[None], np.array([len(prompt)], np.int32))
    caches = model.init_caches(1, len(prompt) + num_new + 1)
    caches = [
        type(c)(k=c.k.at[:, :, : len(prompt)].set(s.k), v=c.v.at[:, :, : len(prompt)].set(s.v))
        for c, s in zip(caches, kv, strict=True)
    ]
    out, tok = [], np.asarray(jnp.argmax(logits, -1), np.int32)
    for i in range(num_new):
        out.append(int(tok[0]))
        logits, caches = model.decode(tok, np.array([len(prompt) + i], np.int32), caches)
        tok = np.asarray(jnp.argmax(logits, -1), np.int32)
    return out


def _hf_logits_and_greedy(path: Path, num_new: int) -> tuple[np.ndarray, list[int]]:
    hf = _hf_from_gguf(path)
    with torch.inference_mode():
        ref = hf(torch.from_numpy(PROMPT[None]).long()).logits.numpy()
        gen = hf.generate(
            torch.from_numpy(PROMPT[None]).long(), attention_mask=torch.ones((1, len(PROMPT)), dtype=torch.long),
            max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return ref, gen[0, len(PROMPT) :].tolist()


def _kernels(model: ShardedModel) -> list[Any]:
    return [
        x
        for rp in model.run_params
        for x in jax.tree.leaves(rp, is_leaf=lambda v: isinstance(v, QuantizedWeight))
        if isinstance(x, QuantizedWeight)
    ]


@pytest.mark.parametrize(
    ("family", "qtype", "k_quants"),
    [
        ("llama", Q.Q4_1, ()),
        ("qwen2", Q.Q8_0, ()),  # tied head, q/k/v biases
        pytest.param("llama", Q.Q4_0, (), marks=pytest.mark.slow),
        pytest.param("llama", Q.Q8_0, (Q.Q4_K, Q.Q5_K, Q.Q6_K), marks=pytest.mark.slow),
    ],
    ids=lambda v: v if isinstance(v, str) else (v.name if hasattr(v, "name") else "-".join(k.name for k in v) or "x"),
)
def test_a_gguf_is_served_as_stored_with_transformers_logits_and_tokens(
    family: str, qtype: Any, k_quants: tuple[Any, ...], tmp_path: Path
) -> None:
    layers = max(2, len(k_quants))
    path = write_gguf(_hf_model(family, seed=3, layers=layers), tmp_path / "m.gguf", qtype, k_quants=k_quants)
    model = ShardedLlama.load(path, tp=1, pp=1, devices=jax.devices()[:1])  # the default: as stored
    served = {w.scheme for w in _kernels(model)}
    assert qtype.name.lower() in served and {k.name.lower() for k in k_quants} <= served
    assert not isinstance(model.run_params[0]["norm"]["scale"], QuantizedWeight)  # F32 norms stay float
    float_model = ShardedLlama.load(path, tp=1, pp=1, devices=jax.devices()[:1], quantization="dequantized")
    assert not _kernels(float_model)
    ref, ref_tokens = _hf_logits_and_greedy(path, 8)
    lengths = np.array([len(PROMPT)], np.int32)
    ours, _ = model.prefill(PROMPT[None], lengths, all_logits=True)
    dequantized, _ = float_model.prefill(PROMPT[None], lengths, all_logits=True)
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(np.asarray(ours), ref, atol=2e-4)
    # the same weights, dequantized in registers instead of at load: only the sums' order differs
    np.testing.assert_allclose(np.asarray(ours), np.asarray(dequantized), atol=2e-5)
    assert _greedy(model, PROMPT, 8) == ref_tokens


@pytest.fixture(scope="module")
def llama_q4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(_hf_model("llama", seed=5, layers=2), tmp_path_factory.mktemp("q4") / "m.gguf", Q.Q4_1)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tp_and_pp_splits_of_a_quantized_model_give_its_logits(llama_q4: Path, tp: int, pp: int) -> None:
    """tp: each device holds its output rows with their scales and mins; pp: each stage its layers' weights."""
    one = ShardedLlama.load(llama_q4, tp=1, pp=1, devices=jax.devices()[:1])
    split = ShardedLlama.load(llama_q4, tp=tp, pp=pp, devices=jax.devices()[: tp * pp])
    weights = _kernels(split)
    assert weights and all(w.scheme == "q4_1" for w in weights)
    if tp > 1:
        gate = split.run_params[0]["layers"][0]["gate_proj"]["kernel"]
        assert gate.values.addressable_shards[0].data.shape[0] == gate.shape[1] // tp
        assert gate.mins.addressable_shards[0].data.shape[0] == gate.shape[1] // tp
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, one.cfg.vocab_size, (2, 10)).astype(np.int32)
    lengths = np.array([10, 6], np.int32)
    ref, _ = one.prefill(tokens, lengths)
    got, _ = split.prefill(tokens, lengths)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5)
    assert _greedy(split, PROMPT, 4) == _greedy(one, PROMPT, 4)


def _decode_logits(model: ShardedModel, steps: int) -> np.ndarray:
    """Logits of `steps` teacher-forced decode steps (batch 1: the kernel's decode path) after PROMPT."""
    _, kv = model.prefill(PROMPT[None], np.array([len(PROMPT)], np.int32))
    caches = model.init_caches(1, len(PROMPT) + steps + 1)
    caches = [
        type(c)(k=c.k.at[:, :, : len(PROMPT)].set(s.k), v=c.v.at[:, :, : len(PROMPT)].set(s.v))
        for c, s in zip(caches, kv, strict=True)
    ]
    out = []
    for i in range(steps):
        tok = np.array([int(PROMPT[i % len(PROMPT)])], np.int32)
        logits, caches = model.decode(tok, np.array([len(PROMPT) + i], np.int32), caches)
        out.append(np.asarray(logits))
    return np.stack(out)


def test_int8_activations_are_selected_at_load_and_stay_close(llama_q4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$JAXSERVE_QUANT_ACTIVATIONS=int8: every GGUF weight decodes with int8 activations (llama.cpp's arithmetic),
    tp splits included; decode logits stay within int8 rounding of x (~0.4 % of a block's largest value) of the
    float32 form's; a bad value is one clear error."""
    exact = ShardedLlama.load(llama_q4, tp=1, pp=1, devices=jax.devices()[:1])
    assert {w.activations for w in _kernels(exact)} == {"float32"}  # the default: parity with the file's floats
    monkeypatch.setenv("JAXSERVE_QUANT_ACTIVATIONS", "int8")
    fast = ShardedLlama.load(llama_q4, tp=1, pp=1, devices=jax.devices()[:1])
    assert {w.activations for w in _kernels(fast)} == {"int8"}
    want, got = _decode_logits(exact, 4), _decode_logits(fast, 4)
    assert not np.array_equal(got, want)  # the int8 form ran
    np.testing.assert_allclose(got, want, atol=0.03 * np.abs(want).max())
    split = ShardedLlama.load(llama_q4, tp=2, pp=1, devices=jax.devices()[:2])  # placed with the same structure
    assert {w.activations for w in _kernels(split)} == {"int8"}
    monkeypatch.setenv("JAXSERVE_QUANT_ACTIVATIONS", "int4")
    with pytest.raises(ValueError, match="JAXSERVE_QUANT_ACTIVATIONS must be one of float32, int8"):
        ShardedLlama.load(llama_q4, tp=1, pp=1, devices=jax.devices()[:1])


# --------------------------------------------------------------------------------------------
# int8 / int4 of a float checkpoint: quality against the float model on a fixed text
# --------------------------------------------------------------------------------------------

TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "for i in range(10):\n    print(i, fibonacci(i))\n"
)
# mean |logprob of the text's next token, quantized - float| and greedy agreement with the float model
QUALITY_BOUNDS = {"int8": (0.01, 0.95), "int4": (0.15, 0.85)}  # measured: 0.0052 / 0.984, 0.074 / 0.922


def quality(quantization: str) -> tuple[float, float]:
    """(mean |logprob diff| of each next token of TEXT, share of positions whose argmax agree) of the shipped
    tiny model (a trained OPT) at `quantization` against itself in float32."""
    from tokenizers import Tokenizer

    source = str(DEFAULT_MODEL_DIR)
    ids = np.asarray(Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).encode(TEXT).ids, np.int32)
    cls = sharded_class(checkpoint.source_config(source))
    out = []
    for q in (None, quantization):
        model = cls.load(source, tp=1, pp=1, devices=jax.devices()[:1], quantization=q)
        logits, _ = model.prefill(ids[None], np.array([len(ids)], np.int32), all_logits=True)
        out.append(np.asarray(jax.nn.log_softmax(logits[0], -1)))  # [T, V]
    ref, got = out
    pick = (np.arange(len(ids) - 1), ids[1:])
    diff = float(np.abs(got[pick] - ref[pick]).mean())
    agree = float((got.argmax(-1) == ref.argmax(-1)).mean())
    return diff, agree


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_weight_only_quantization_stays_close_to_the_float_model(quantization: str) -> None:
    diff, agree = quality(quantization)
    max_diff, min_agree = QUALITY_BOUNDS[quantization]
    assert 0 < diff <= max_diff and agree >= min_agree, (diff, agree)


def test_int8_kernels_and_tied_head_are_quantized_per_channel() -> None:
    source = str(DEFAULT_MODEL_DIR)
    cls = sharded_class(checkpoint.source_config(source))
    model = cls.load(source, tp=1, pp=1, devices=jax.devices()[:1], quantization="int8")
    state = model.run_params[0]
    head = state["embed_tokens"]["embedding"]
    assert isinstance(head, QuantizedWeight) and head.shape == (model.cfg.embed_dim, model.cfg.vocab_size)
    qkv = state["layers"][0]["qkv_proj"]["kernel"]  # one-device stage: q/k/v fused, quantized as one
    assert qkv.scheme == "int8" and qkv.scales.shape == (3 * model.cfg.hidden_size, 1)
    assert not isinstance(state["embed_positions"]["embedding"], QuantizedWeight)
    assert model.dtype == jnp.float32


# --------------------------------------------------------------------------------------------
# Refusals: one clear error before serving
# --------------------------------------------------------------------------------------------


def test_a_quantized_model_is_not_saved_as_a_float_checkpoint(llama_q4: Path, tmp_path: Path) -> None:
    model = ShardedLlama.load(llama_q4, tp=1, pp=1, devices=jax.devices()[:1])
    with pytest.raises(QuantizationError, match="float weights"):
        checkpoint.save_checkpoint(tmp_path / "ckpt", model)
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(QuantizationError, match="float weights"):
        _ = model.stage_params


@pytest.mark.parametrize(
    ("quantization", "gguf_source", "platform", "match"),
    [
        ("int8", True, "cpu", "already quantized"),
        ("int3", False, "cpu", "unknown quantization 'int3'"),
        ("fp8", False, "cpu", "fp8 needs a device"),
        ("dequantized", False, "cpu", "applies to a GGUF"),
    ],
)
def test_a_precision_that_cannot_be_served_is_one_clear_error(
    quantization: str, gguf_source: bool, platform: str, match: str
) -> None:
    with pytest.raises(QuantizationError, match=match):
        check_quantization(quantization, gguf=gguf_source, platform=platform)


def test_quantization_on_a_gguf_is_refused_before_any_weight_is_read(llama_q4: Path) -> None:
    with pytest.raises(QuantizationError, match="already quantized"):
        ShardedLlama.load(llama_q4, tp=1, pp=1, devices=jax.devices()[:1], quantization="int4")


def test_a_corrupt_scale_tensor_is_one_clear_error(tmp_path: Path) -> None:
    """A Q8_0 tensor whose f16 scales are NaN / inf: named, before serving (not garbage logits)."""
    path = write_gguf(_hf_model("llama", seed=3, layers=2), tmp_path / "m.gguf", Q.Q8_0)
    raw = bytearray(path.read_bytes())
    info = checkpoint.gguf.open_gguf(path).tensors["blk.1.ffn_up.weight"]
    raw[info.data_offset : info.data_offset + 2] = np.array([np.inf], np.float16).tobytes()  # first block's scale
    path.write_bytes(bytes(raw))
    with pytest.raises(QuantFormatError, match=r"blk\.1\.ffn_up\.weight.*not finite"):
        ShardedLlama.load(path, tp=1, pp=1, devices=jax.devices()[:1])


# --------------------------------------------------------------------------------------------
# The runtime: each instance at its plan's precision, the live switch tells precisions apart
# --------------------------------------------------------------------------------------------


def test_each_instance_loads_at_its_plans_precision_else_the_default() -> None:
    """`model_engine_factory` (what the embedded backend, `LLM` and the live switch build instances with): an
    `InstanceSpec.quantization` wins over the deployment's `--quantization`; the state the engine's jitted steps
    take holds the quantized weights."""
    from jaxserve.core.plan import InstanceSpec
    from jaxserve.runtime.engines.model import model_engine_factory

    factory = model_engine_factory(str(DEFAULT_MODEL_DIR), quantization="int8")
    schemes = []
    for spec in (InstanceSpec("decode"), InstanceSpec("prefill", quantization="int4")):
        engine = factory(spec, jax.devices()[:1])
        schemes.append({w.scheme for w in _kernels(engine.model)})
    assert schemes == [{"int8"}, {"int4"}]


def test_the_live_switch_reloads_an_instance_whose_precision_changes() -> None:
    from jaxserve.core.plan import DeploymentPlan, InstanceSpec
    from jaxserve.runtime.switch import match_instances

    routed = [("d0", InstanceSpec("decode")), ("p0", InstanceSpec("prefill", quantization="int8"))]
    plan = DeploymentPlan((InstanceSpec("prefill", quantization="int8"), InstanceSpec("decode", quantization="int4")))
    pairs, retire = match_instances(routed, plan)
    assert [kept for _, kept in pairs] == ["p0", None] and retire == ["d0"]


def test_16_bit_weights_on_the_cpu_are_refused_with_the_reason() -> None:
    from jaxserve.runtime.engines.model import ModelEngine

    with pytest.raises(QuantizationError, match="no 16-bit matmul fast path"):
        ModelEngine.load(str(DEFAULT_MODEL_DIR), jax.devices()[:1], dtype="bfloat16")


def test_serve_ends_on_quantization_of_a_gguf_with_one_line(llama_q4: Path) -> None:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "jaxserve", "serve", "--model", str(llama_q4), "--quantization", "int8",
           "--grpc-port", "0", "--http-port", "0", "--no-warmup", "--compile-cache", "off"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "error: --quantization int8 asks to re-quantize a GGUF file" in proc.stderr


def test_the_models_precisions_are_the_plans() -> None:
    """`models` cannot import `jaxserve` (the dependency rule): its list of precisions is the contract's, kept equal."""
    from jaxserve.core.plan import QUANTIZATIONS as PLAN_QUANTIZATIONS
    from models.quantize import QUANTIZATIONS

    assert QUANTIZATIONS == PLAN_QUANTIZATIONS
