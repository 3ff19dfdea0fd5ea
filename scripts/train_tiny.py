"""Train `opt-code-tiny`: a small OPT on the Python standard library's source, shipped with jaxserve.

The embedded default server needs weights that print something better than noise. This script
makes them on a laptop-class CPU in about ten minutes:

1. Corpus: every `.py` file under `sysconfig.get_paths()["stdlib"]`, minus test directories,
   `site-packages`, `encodings` (character tables) and `pydoc_data` (one 750 KB docs string).
   A few files, picked by a hash of their path (so the choice is stable), are held out for
   validation and never seen by the tokenizer or the model.
2. Tokenizer: byte-level BPE trained with `tokenizers` on the training files (pre-tokenized so
   that spaces end words, see `PRETOKENIZE_PATTERN`). Ids 0-3 are the
   special tokens `<s> <pad> </s> <unk>`, so the OPT convention pad=1, bos=eos=2 holds; the
   post-processor puts `</s>` in front of every encoded text, like OPT's GPT-2 tokenizer does.
3. Data: each file becomes `</s>` + its tokens; the files are concatenated into one stream and
   training windows are cut at random offsets (the model sees file starts at every position).
4. Model and loss: the `models.opt.OPT` module (`flax.nnx`), its serving prefill with all-position logits
   (`models.decoder.stage_prefill`) under next-token cross-entropy; AdamW (optax) with warm-up and cosine
   decay, applied by `nnx.Optimizer`. Most steps use windows of
   `--seq-len` tokens; the last `--long-frac` of steps use `max_position_embeddings` (512) so every
   position row the server can read has been trained.
5. Output (`--out`, default `jaxserve/assets/opt-code-tiny/`): a Hugging Face directory written by
   `models.checkpoint.save_hf_checkpoint` (`model.safetensors` in `--save-dtype`, `config.json`), `tokenizer.json`
   and `train_info.json` (corpus split, held-out files, loss curve, wall time, a sample). The script
   then restores the directory through `ShardedOPT.load` and reports the held-out loss again.

`--smoke` runs the whole path in seconds on a handful of files with a toy model into a temp dir.

    .venv/bin/python scripts/train_tiny.py            # the shipped model (~10 min on 2 cores)
    .venv/bin/python scripts/train_tiny.py --smoke    # a few steps, temp output dir
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")  # ids 0..3: pad=1, bos=eos=2 as in OPT
PAD_ID, BOS_ID = 1, 2
MODEL_NAME = "opt-code-tiny"
DEFAULT_OUT = REPO_ROOT / "jaxserve" / "assets" / MODEL_NAME
# Directory names skipped anywhere in a path (plus any directory whose name starts with "test").
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "idle_test", "encodings", "pydoc_data"})


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith(("test", "config-"))


def corpus_files(root: Path) -> list[str]:
    """Relative paths (POSIX, sorted) of the standard-library sources used as corpus."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _excluded_dir(d)]  # prune: never walk site-packages
        rel_dir = Path(dirpath).relative_to(root)
        out += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    return sorted(out)


def _path_hash(rel: str) -> str:
    return hashlib.sha1(rel.encode()).hexdigest()


def split_files(root: Path, files: Sequence[str], num_val: int) -> tuple[list[str], list[str]]:
    """Hold out `num_val` mid-sized files (4-40 KB) chosen by path hash; the rest train."""
    candidates = [f for f in files if 4_000 <= (root / f).stat().st_size <= 40_000]
    val = sorted(sorted(candidates, key=_path_hash)[:num_val])
    held = set(val)
    return [f for f in files if f not in held], val


def read_texts(root: Path, files: Sequence[str]) -> list[str]:
    return [(root / f).read_text(encoding="utf-8", errors="replace") for f in files]


# ------------------------------------------------------------------------------------------------
# Tokenizer and token stream
# ------------------------------------------------------------------------------------------------


# Pre-tokenization for code: identifiers (with underscores), numbers and punctuation runs each take
# ONE trailing space; other whitespace (newline + indentation) is its own piece. GPT-2's pattern puts
# the space in front of the next word instead, so a prompt ending in a space ("def ", "import ") or
# in indentation ends on a lone-space token the model never saw in that place during training.
# With spaces at the end, the places where people stop typing are token boundaries in training too.
PRETOKENIZE_PATTERN = r"[\p{L}_][\p{L}\p{N}_]* ?|\p{N}+ ?|[^\s\p{L}\p{N}_]+ ?|\s+"


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """Byte-level BPE (code-aware pre-tokenization) with OPT's special ids and `</s>` BOS."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, f"special token {name} got id {tok.token_to_id(name)}, expected {i}"
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", special_tokens=[("</s>", BOS_ID)])
    return tok


def token_stream(tok: Any, texts: Sequence[str]) -> np.ndarray:
    """`</s>` + tokens of each text, concatenated: int32 [N]."""
    encoded = tok.encode_batch(list(texts))  # the post-processor adds the leading </s>
    return np.concatenate([np.asarray(e.ids, np.int32) for e in encoded])


def random_windows(stream: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, seq_len + 1] windows at random offsets (inputs are [:, :-1], targets [:, 1:])."""
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch)
    return np.stack([stream[s : s + seq_len + 1] for s in starts])


def fixed_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows from the start of `stream` (the validation set)."""
    n = min(max_windows, (len(stream) - 1) // seq_len)
    return np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    vocab_size: int = 4096
    hidden: int = 192
    layers: int = 4
    heads: int = 4
    ffn: int = 768
    max_positions: int = 512
    steps: int = 1200
    tokens_per_step: int = 2048
    seq_len: int = 128
    long_frac: float = 0.1
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    num_val_files: int = 8
    max_files: int = 0  # 0 = all
    eval_every: int = 100
    seed: int = 0
    save_dtype: str = "bfloat16"
    sample_tokens: int = 48


SMOKE = TrainSettings(
    vocab_size=384,
    hidden=32,
    layers=2,
    heads=2,
    ffn=64,
    max_positions=32,
    steps=3,
    tokens_per_step=128,
    seq_len=32,
    long_frac=0.0,
    warmup=1,
    num_val_files=1,
    max_files=6,
    eval_every=3,
    save_dtype="bfloat16",
    sample_tokens=0,
)


def _decay_mask(params: Any) -> Any:
    """Weight decay on matrices (kernels, embedding tables) only; not on biases or LayerNorms."""
    import jax

    def wants_decay(path: tuple[Any, ...], _: Any) -> bool:
        name = jax.tree_util.keystr(path)  # the module-state path: ...['fc1']['kernel'], ['embed_tokens']['embedding']
        return "'kernel'" in name or "'embedding'" in name

    return jax.tree_util.tree_map_with_path(wants_decay, params)


def make_train_fns(cfg: Any, s: TrainSettings) -> tuple[Any, Any, Any]:
    """(optax transform, jitted train step, jitted loss) around the serving forward pass of the NNX model.

    The train step takes the model and its `nnx.Optimizer` and updates both in place; the loss is the
    serving prefill's all-position logits (`models.decoder.stage_prefill`) against the next tokens.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from models import decoder

    def loss_fn(model: Any, windows: jax.Array) -> jax.Array:
        inputs, targets = windows[:, :-1], windows[:, 1:]  # [B, T]
        lengths = jnp.full((inputs.shape[0],), inputs.shape[1], jnp.int32)
        logits, _ = decoder.stage_prefill(model, inputs, lengths, all_logits=True)  # [B, T, V] float32
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=s.lr, warmup_steps=s.warmup, decay_steps=s.steps, end_value=s.lr * 0.1
    )
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=s.weight_decay, mask=_decay_mask),
    )

    @nnx.jit
    def train_step(model: Any, optimizer: Any, windows: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(loss_fn)(model, windows)
        optimizer.update(model, grads)
        return loss

    return tx, train_step, nnx.jit(loss_fn)


def mean_loss(loss_fn: Any, model: Any, windows: np.ndarray, batch: int = 8) -> float:
    """Token-weighted mean loss over fixed windows (equal-size chunks; the ragged tail is dropped)."""
    n = (len(windows) // batch) * batch or len(windows)
    chunks = [windows[i : i + batch] for i in range(0, n, batch)]
    return float(np.mean([float(loss_fn(model, c)) for c in chunks]))


def batch_schedule(s: TrainSettings) -> Iterator[tuple[int, int]]:
    """(batch, seq_len) per step: short windows first, full-length windows for the last `long_frac`."""
    long_from = s.steps - round(s.steps * s.long_frac)
    for step in range(s.steps):
        seq = s.max_positions if step >= long_from else s.seq_len
        yield max(1, s.tokens_per_step // seq), seq


def greedy_complete(model: Any, tok: Any, prompt: str, max_new_tokens: int, width: int) -> str:
    """Greedy continuation through a loaded `ShardedOPT` (one fixed-width padded prefill per token)."""
    ids = tok.encode(prompt).ids
    new: list[int] = []
    for _ in range(max_new_tokens):
        seq = (ids + new)[-width:]
        tokens = np.full((1, width), PAD_ID, np.int32)
        tokens[0, : len(seq)] = seq
        logits, _ = model.prefill(tokens, np.array([len(seq)], np.int32))  # [1, V]
        nxt = int(np.argmax(np.asarray(logits)[0]))
        if nxt == BOS_ID:
            break
        new.append(nxt)
    return str(tok.decode(new))


def train(s: TrainSettings, out: Path, log_every: int = 10) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import opt
    from models import params as module_params
    from models.checkpoint import load_tokenizer, save_hf_checkpoint
    from models.config import OPTConfig
    from models.sharding import ShardedOPT

    t_start = time.perf_counter()
    root = stdlib_root()
    files = corpus_files(root)
    if s.max_files:
        files = files[:: max(1, len(files) // s.max_files)][: s.max_files]
    train_files, val_files = split_files(root, files, s.num_val_files)
    if not val_files:  # tiny --max-files selections may have no mid-sized file
        train_files, val_files = files[1:], files[:1]
    train_texts, val_texts = read_texts(root, train_files), read_texts(root, val_files)
    print(
        f"corpus: {root}: {len(train_files)} train files ({sum(map(len, train_texts)) / 1e6:.1f} M chars), "
        f"{len(val_files)} held out: {', '.join(val_files)}",
        flush=True,
    )

    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, s.vocab_size)
    train_stream, val_stream = token_stream(tok, train_texts), token_stream(tok, val_texts)
    chars_per_token = sum(map(len, train_texts)) / len(train_stream)
    print(
        f"tokenizer: vocab {tok.get_vocab_size()} in {time.perf_counter() - t0:.1f}s; "
        f"{len(train_stream) / 1e6:.2f} M train tokens, {len(val_stream)} val tokens, "
        f"{chars_per_token:.2f} chars/token",
        flush=True,
    )

    cfg = OPTConfig(
        name=MODEL_NAME,
        hidden_size=s.hidden,
        ffn_dim=s.ffn,
        num_layers=s.layers,
        num_heads=s.heads,
        vocab_size=tok.get_vocab_size(),
        max_position_embeddings=s.max_positions,
        do_layer_norm_before=True,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=BOS_ID,
        dtype="float32",
    )
    model = opt.OPT(cfg, rngs=nnx.Rngs(s.seed))  # normal(0.02) matrices, zero biases, unit LayerNorm scales
    num_params = opt.num_params(nnx.state(model, nnx.Param))
    print(
        f"model: hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads, ffn {cfg.ffn_dim}, "
        f"vocab {cfg.vocab_size}, positions {cfg.max_position_embeddings}: {num_params / 1e6:.2f} M params",
        flush=True,
    )
    tx, train_step, loss_fn = make_train_fns(cfg, s)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    rng = np.random.default_rng(s.seed)
    val_windows = fixed_windows(val_stream, s.seq_len, max_windows=48)

    curve: list[dict[str, float]] = []
    ema: float | None = None
    tokens_seen = 0
    t_train = time.perf_counter()
    for step, (batch, seq) in enumerate(batch_schedule(s), start=1):
        windows = random_windows(train_stream, batch, seq, rng)
        loss = train_step(model, optimizer, jnp.asarray(windows))
        tokens_seen += batch * seq
        loss_f = float(loss)
        ema = loss_f if ema is None else 0.9 * ema + 0.1 * loss_f
        if step % s.eval_every == 0 or step == s.steps:
            val = mean_loss(loss_fn, model, val_windows)
            elapsed = time.perf_counter() - t_train
            curve.append(
                {"step": step, "train_loss": round(ema, 4), "val_loss": round(val, 4), "elapsed_s": round(elapsed, 1)}
            )
            print(
                f"step {step:5d}  train {ema:.3f}  val {val:.3f}  {tokens_seen / elapsed:.0f} tok/s  {elapsed:.0f}s",
                flush=True,
            )
        elif step % log_every == 0:
            print(f"step {step:5d}  train {ema:.3f}  seq {seq}", flush=True)
    train_s = time.perf_counter() - t_train

    # Save through the serving checkpoint code, then read it back the way the server will.
    device = jax.devices()[0]
    save_cfg = cfg.with_dtype(s.save_dtype)
    params = module_params.params_from_state(cfg, nnx.state(model, nnx.Param))  # the checkpoint layout
    save_params = jax.tree.map(lambda a: np.asarray(a).astype(jnp.dtype(s.save_dtype)), params)
    if out.exists():
        shutil.rmtree(out)
    save_hf_checkpoint(out, save_params, save_cfg)
    tok.save(str(out / "tokenizer.json"))
    restored = ShardedOPT.load(out, tp=1, pp=1, devices=[device], dtype="float32")
    tok2 = load_tokenizer(out)
    assert tok2 is not None
    val_restored = mean_loss(loss_fn, nnx.merge(restored.graphdefs[0], restored.run_params[0]), val_windows)
    prompts = ["def ", "import ", "class "] if s.sample_tokens else []
    width = min(cfg.max_position_embeddings, 128)
    samples = {p: greedy_complete(restored, tok2, p, s.sample_tokens, width) for p in prompts}

    info = {
        "model": dataclasses.asdict(save_cfg),
        "num_params": num_params,
        "settings": dataclasses.asdict(s),
        "corpus": {
            "python": platform.python_version(),
            "stdlib": str(root),
            "num_train_files": len(train_files),
            "train_chars": sum(map(len, train_texts)),
            "train_tokens": len(train_stream),
            "chars_per_token": round(chars_per_token, 3),
            "heldout_files": val_files,
            "train_files": train_files,
            "heldout_tokens": len(val_stream),
            "excluded_dirs": [*sorted(EXCLUDED_DIRS), "test*"],
        },
        "tokens_seen": tokens_seen,
        "train_wall_s": round(train_s, 1),
        "total_wall_s": round(time.perf_counter() - t_start, 1),
        "loss_curve": curve,
        "final_train_loss": curve[-1]["train_loss"],
        "final_val_loss": curve[-1]["val_loss"],
        "val_loss_after_save": round(val_restored, 4),
        "samples_greedy": samples,
    }
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"saved {out} ({size / 1e6:.2f} MB); train {train_s:.0f}s; val loss after save/restore {val_restored:.3f}")
    for p, text in samples.items():
        print(f"--- greedy {p!r}\n{p}{text}")
    return info


def parse_args(argv: Sequence[str] | None) -> tuple[TrainSettings, Path]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--smoke", action="store_true", help="a few steps of a toy model on a handful of files (seconds)")
    ap.add_argument(
        "--out", type=Path, default=None, help=f"output directory (default {DEFAULT_OUT}; --smoke: a temp dir)"
    )
    defaults = TrainSettings()
    for field in dataclasses.fields(TrainSettings):
        flag = "--" + field.name.replace("_", "-")
        ap.add_argument(
            flag,
            type=type(getattr(defaults, field.name)),
            default=None,
            help=f"default {getattr(defaults, field.name)}",
        )
    args = ap.parse_args(argv)
    base = SMOKE if args.smoke else defaults
    overrides = {
        f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings) if getattr(args, f.name) is not None
    }
    settings = dataclasses.replace(base, **overrides)
    out = args.out or (Path(tempfile.mkdtemp(prefix="opt-code-tiny-smoke-")) if args.smoke else DEFAULT_OUT)
    return settings, out


def main(argv: Sequence[str] | None = None) -> int:
    settings, out = parse_args(argv)
    if math.isclose(settings.long_frac, 0.0) and settings.seq_len < settings.max_positions:
        print(f"note: positions >= {settings.seq_len} will not be trained (--long-frac 0)", flush=True)
    train(settings, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
