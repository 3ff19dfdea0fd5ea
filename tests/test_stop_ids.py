"""Every stop id a checkpoint declares ends generation, as transformers' `generate` ends it.

Llama 3 Instruct's `config.json` names one EOS (`<|end_of_text|>`), while its `generation_config.json`
lists `<|eot_id|>` too, the end of every chat turn: a server that read only config.json would run each
reply to `max_tokens`. A tiny random Llama is saved as a Hugging Face directory whose generation
config declares, as a second end, the token greedy decoding reaches third; transformers' `generate`
on that directory stops there, and so must jaxserve (finish reason `stop`), while `ignore_eos` ignores
every declared id. A tokenizer's `eos_token` and a GGUF file's eos / eot / eom ids count too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llama_hf import make_hf_llama, save_hf_llama  # noqa: E402

import jaxserve  # noqa: E402
from jaxserve.core.limits import ServingLimits  # noqa: E402
from models.checkpoint import load_hf_model_config  # noqa: E402
from models.config import LlamaConfig  # noqa: E402
from models.stop_ids import tokenizer_eos_id  # noqa: E402

PROMPT = [1, 17, 42, 99, 5]


def _save_tokenizer(path: Path, eos: str | None = None) -> object:
    """A word-level tokenizer of the model's 160 ids (`t0`..`t159`), `eos` added as one more special token."""
    from tokenizers import Tokenizer, models

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(160 - (eos is not None))}, unk_token="t0"))
    if eos is not None:
        backend.add_special_tokens([eos])  # id 159, an added token
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, unk_token="t0")
    tok.save_pretrained(path)
    return tok


def _greedy(model: object, num_new: int, **generate: object) -> list[int]:
    with torch.inference_mode():
        out = model.generate(  # type: ignore[attr-defined]
            torch.tensor([PROMPT]), attention_mask=torch.ones((1, len(PROMPT)), dtype=torch.long),
            max_new_tokens=num_new, do_sample=False, pad_token_id=0, **generate,
        )  # fmt: skip
    return out[0, len(PROMPT) :].tolist()


def test_generation_config_stop_ids_end_generation_as_in_transformers(tmp_path: Path) -> None:
    hf = make_hf_llama("llama-gqa-llama3", seed=11)
    free = _greedy(hf, 8, eos_token_id=None, min_new_tokens=8)
    stop_at = next(k for k in range(2, 8) if free[k] not in free[:k] and free[k] != 2)
    eot = free[stop_at]  # the model's own third-or-later token plays <|eot_id|>
    path = save_hf_llama(hf, tmp_path / "llama3-instruct")
    _save_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, eot]}))
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == 2  # config.json names one EOS

    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval()
    expected = _greedy(reference, 8)
    assert expected == free[: stop_at + 1]  # transformers stops on the generation config's id

    cfg = load_hf_model_config(path)
    assert isinstance(cfg, LlamaConfig) and cfg.eos_token_ids == (2, eot) and cfg.eos_token_id == 2
    with jaxserve.LLM(model=str(path), limits=ServingLimits(block_size=8, num_kv_blocks=16)) as llm:
        (out,) = llm.generate([PROMPT], jaxserve.SamplingParams(max_tokens=8, temperature=0.0))
        (ignored,) = llm.generate([PROMPT], jaxserve.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert list(out.token_ids) == expected and out.finish_reason == "stop"
    assert list(ignored.token_ids) == free and ignored.finish_reason == "length"


def test_the_tokenizers_eos_token_is_a_stop_id(tmp_path: Path) -> None:
    path = save_hf_llama(make_hf_llama("mistral-mha", seed=1), tmp_path / "m")
    tok = _save_tokenizer(path, eos="<|im_end|>")
    assert tokenizer_eos_id(path) == tok.eos_token_id == 159  # type: ignore[attr-defined]
    assert load_hf_model_config(path).eos_token_ids == (2, 159)  # type: ignore[union-attr]
