"""Files shipped inside the package: the embedded default model.

`opt-code-tiny/` is a small OPT trained on the Python standard library by `scripts/train_tiny.py`:
a Hugging Face directory (`config.json`, `model.safetensors` in bfloat16; `transformers` loads it as it
is), its byte-level BPE `tokenizer.json`, and `train_info.json` (corpus split, held-out files, loss curve).
Not an Orbax checkpoint, though jaxserve writes and serves those too: the import of Orbax (with
tensorstore) alone cost every start of `jaxserve serve` on this model ~0.25 s.
Load it with `models.sharding.ShardedOPT.load(default_model_path(), ...)` and
`models.checkpoint.load_tokenizer(default_model_path())`.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_NAME = "opt-code-tiny"
ASSETS_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = ASSETS_DIR / DEFAULT_MODEL_NAME


def default_model_path() -> Path:
    """Directory of the shipped default model; raises FileNotFoundError if the package lacks it."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_DIR} has no checkpoint; run `python scripts/train_tiny.py` to create it"
        )
    return DEFAULT_MODEL_DIR
