"""The shipped default model (`jaxserve/assets/opt-code-tiny`) and the script that trains it.

Everything goes through the serving code: `ShardedOPT.load` reads the Hugging Face directory
(`model.safetensors`) and `load_tokenizer` reads `tokenizer.json`; transformers reads the same files
as an independent check of the weights' names and layout. Quality is measured, not assumed: the held-out loss is
compared with a unigram model fitted on training files, and greedy completions must lex as Python.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import sysconfig
import tokenize
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxserve.assets import DEFAULT_MODEL_DIR, default_model_path
from models.checkpoint import load_tokenizer
from models.sharding import ShardedOPT

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def info() -> dict:
    return json.loads((default_model_path() / "train_info.json").read_text())


@pytest.fixture(scope="module")
def tok():
    t = load_tokenizer(default_model_path())
    assert t is not None
    return t


@pytest.fixture(scope="module")
def model() -> ShardedOPT:
    return ShardedOPT.load(default_model_path(), tp=1, pp=1, devices=jax.devices()[:1], dtype="float32")


def heldout_text(info: dict, max_chars: int = 6000) -> str:
    """Start of the first held-out stdlib file found on this machine (never seen by tokenizer or model)."""
    for rel in info["corpus"]["heldout_files"]:
        path = STDLIB / rel
        if path.exists():
            return path.read_text(encoding="utf-8")[:max_chars]
    pytest.fail(f"none of the held-out files {info['corpus']['heldout_files']} exist under {STDLIB}")


def token_nll(model: ShardedOPT, ids: list[int], width: int) -> np.ndarray:
    """Per-token next-token NLL (nats) of `ids` under the model, in chunks of `width` tokens."""
    losses = []
    for start in range(0, len(ids) - 1, width):
        chunk = ids[start : start + width + 1]
        tokens = np.asarray(chunk[:-1], np.int32)[None]
        logits, _ = model.prefill(tokens, np.array([tokens.shape[1]], np.int32), all_logits=True)
        logp = jax.nn.log_softmax(np.asarray(logits[0], np.float32), axis=-1)
        losses.append(-np.asarray(logp)[np.arange(len(chunk) - 1), chunk[1:]])
    return np.concatenate(losses)


def greedy(model: ShardedOPT, tok, prompt: str, n: int, width: int = 64) -> list[int]:
    ids = tok.encode(prompt).ids
    out: list[int] = []
    for _ in range(n):
        seq = ids + out
        tokens = np.full((1, width), model.cfg.pad_token_id, np.int32)
        tokens[0, : len(seq)] = seq
        logits, _ = model.prefill(tokens, np.array([len(seq)], np.int32))
        nxt = int(np.argmax(np.asarray(logits)[0]))
        if nxt == model.cfg.eos_token_id:
            break
        out.append(nxt)
    return out


def test_default_model_path_and_size() -> None:
    path = default_model_path()
    assert path == DEFAULT_MODEL_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "train_info.json"):
        assert (path / name).exists(), name
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size <= 20e6, f"shipped model is {size / 1e6:.1f} MB"


def test_config_matches_tokenizer(model: ShardedOPT, tok) -> None:
    cfg = model.cfg
    assert cfg.name == "opt-code-tiny"
    assert cfg.do_layer_norm_before and cfg.max_position_embeddings == 512
    assert cfg.vocab_size == tok.get_vocab_size()
    assert tok.token_to_id("<pad>") == cfg.pad_token_id == 1
    assert tok.token_to_id("</s>") == cfg.bos_token_id == cfg.eos_token_id == 2
    assert json.loads((default_model_path() / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_transformers_reads_the_shipped_model_as_we_do(model: ShardedOPT, tok) -> None:
    """The shipped files are a plain Hugging Face checkpoint: transformers' OPT on them gives our logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = np.asarray(tok.encode("import os\n\ndef main(argv):\n    return 0\n").ids, np.int32)[None]
    ours, _ = model.prefill(ids, np.array([ids.shape[1]], np.int32), all_logits=True)
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=1e-4, rtol=1e-4)


def test_tokenizer_round_trips_python_source(tok, info: dict) -> None:
    texts = [
        heldout_text(info),
        (STDLIB / "textwrap.py").read_text(encoding="utf-8"),
        "def f(x):\n\treturn {'ü': x ** 2}  # ünïcode, tabs and trailing spaces   \n\n\n",
    ]
    for text in texts:
        enc = tok.encode(text)
        assert enc.ids[0] == 2, "encode puts OPT's </s> BOS first"
        assert tok.decode(enc.ids) == text
        assert len(enc.ids) < len(text) / 2, "BPE should compress source well below one token per character"


def test_any_layout_restores_the_same_model(model: ShardedOPT, tok) -> None:
    ids = np.asarray(tok.encode("import os\n\ndef main(argv):\n    return 0\n").ids, np.int32)[None]
    lengths = np.array([ids.shape[1]], np.int32)
    ref, _ = model.prefill(ids, lengths, all_logits=True)
    sharded = ShardedOPT.load(default_model_path(), tp=2, pp=2, devices=jax.devices()[:4], dtype="float32")
    got, _ = sharded.prefill(ids, lengths, all_logits=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-4, rtol=2e-4)


def test_heldout_loss_beats_unigram_baseline(model: ShardedOPT, tok, info: dict) -> None:
    ids = tok.encode(heldout_text(info)).ids[:1025]
    nll = float(token_nll(model, ids, width=256).mean())
    # Baseline: a unigram model (add-one smoothed) fitted on every 10th training file, the same
    # kind of data the transformer saw, scored on the same held-out tokens.
    root = Path(info["corpus"]["stdlib"]) if Path(info["corpus"]["stdlib"]).exists() else STDLIB
    files = [root / f for f in info["corpus"]["train_files"][::10] if (root / f).exists()]
    assert len(files) > 20
    counts = Counter(i for e in tok.encode_batch([f.read_text(encoding="utf-8") for f in files]) for i in e.ids[1:])
    n, v = sum(counts.values()), model.cfg.vocab_size
    unigram = float(np.mean([-math.log((counts[i] + 1) / (n + v)) for i in ids[1:]]))
    assert nll < unigram - 1.5, (
        f"held-out NLL {nll:.2f} nats/token vs unigram {unigram:.2f} (uniform {math.log(v):.2f})"
    )


@pytest.mark.parametrize(
    ("prompt", "pattern_first_token"),
    [("def ", tokenize.NAME), ("import ", tokenize.NAME), ("class ", tokenize.NAME)],
)
def test_greedy_completion_reads_like_python(model: ShardedOPT, tok, prompt: str, pattern_first_token: int) -> None:
    completion = tok.decode(greedy(model, tok, prompt, 24))
    text = prompt + completion
    assert completion.strip(), f"empty completion for {prompt!r}"
    assert completion.isascii() and all(c.isprintable() or c in "\n\t" for c in completion), repr(completion)
    # The first line must lex as Python, and the keyword must be followed by an identifier.
    first_line = text.split("\n", 1)[0] + "\n"
    toks = [t for t in tokenize.generate_tokens(io.StringIO(first_line).readline) if t.type != tokenize.NEWLINE]
    assert toks[0].string == prompt.strip()
    assert toks[1].type == pattern_first_token, f"{text!r}: {prompt.strip()} is not followed by a name"
    assert not any(t.type == tokenize.ERRORTOKEN for t in toks), f"{first_line!r} does not lex as Python"


@pytest.mark.slow  # ~20 s: a training run; the default run stays well under 15 minutes
def test_train_script_smoke(tmp_path: Path) -> None:
    out = tmp_path / "model"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "train_tiny.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    smoke_info = json.loads((out / "train_info.json").read_text())
    assert smoke_info["loss_curve"][-1]["step"] == smoke_info["settings"]["steps"]
    assert all(math.isfinite(p["val_loss"]) for p in smoke_info["loss_curve"])
    assert set(smoke_info["corpus"]["heldout_files"]).isdisjoint(smoke_info["corpus"].get("train_files", []))
    restored = ShardedOPT.load(out, tp=1, pp=1, devices=jax.devices()[:1], dtype="float32")
    smoke_tok = load_tokenizer(out)
    assert smoke_tok is not None and restored.cfg.vocab_size == smoke_tok.get_vocab_size()
    assert restored.cfg.max_position_embeddings == smoke_info["model"]["max_position_embeddings"]
