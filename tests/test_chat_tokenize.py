"""A chat prompt is tokenized as transformers' `apply_chat_template(..., tokenize=True)` tokenizes it: one BOS.

Templates that write `{{ bos_token }}` (Llama 3, Mistral) over a tokenizer whose post-processor adds BOS
too would start every chat prompt with two BOS tokens if the rendered text were encoded with special
tokens on. Small tokenizers are built here the way those checkpoints ship theirs (a BOS-adding
post-processor for Llama 3 and Mistral, none for SmolLM2 and Qwen2), saved as Hugging Face directories,
read back by our loaders and by `transformers.AutoTokenizer`, and the prompt ids our frontend sends to the
engine (HTTP's and gRPC's request paths) are compared with transformers'. Completions prompts keep the
tokenizer's special tokens (BOS), as transformers' `tokenizer(text)` does.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from serving_helpers import fake_controller

transformers = pytest.importorskip("transformers")

from jaxserve.proto import jaxserve_pb2 as pb  # noqa: E402
from jaxserve.serving import wire  # noqa: E402
from jaxserve.serving.frontend import Frontend  # noqa: E402
from jaxserve.serving.openai_protocol import (  # noqa: E402
    ChatCompletionRequest,
    CompletionRequest,
    chat_job,
    completion_job,
)
from models.checkpoint import load_chat_template, load_tokenizer  # noqa: E402

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
CHATML_DEFAULT_SYSTEM = (  # SmolLM2 and Qwen2: ChatML, a default system turn, no BOS anywhere
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n' + default_system + '<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = {  # template, bos, eos, whether the post-processor adds BOS
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", True),
    "mistral": (MISTRAL, "<s>", "</s>", True),
    "smollm2": (CHATML_DEFAULT_SYSTEM.replace("default_system", "'You are a helpful AI assistant named SmolLM.'"),
                None, "<|im_end|>", False),
    "qwen2": (CHATML_DEFAULT_SYSTEM.replace("default_system", "'You are a helpful assistant.'"), None,
              "<|endoftext|>", False),
}  # fmt: skip
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<s>", "</s>",
            "[INST]", "[/INST]", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]  # fmt: skip
CORPUS = ["Hello there, how are you today?", "What is 2+2? It is four.", "system user assistant", "Be brief."]
MESSAGES = [[{"role": "user", "content": "Hello there!"}],
            [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "four"},
             {"role": "user", "content": "Be brief."}]]  # fmt: skip


def _hf_dir(tmp_path: Path, family: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template, bos, eos, adds_bos = FAMILIES[family]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    )
    if adds_bos:  # as Llama 3's and Mistral's tokenizer.json do
        assert bos is not None
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, backend.token_to_id(bos))]
        )
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tok.chat_template = template
    path = tmp_path / family
    tok.save_pretrained(path)
    return path


def _ids(out: object) -> list[int]:
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)  # type: ignore[index]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_prompt_ids_equal_transformers_apply_chat_template(family: str, tmp_path: Path) -> None:
    path = _hf_dir(tmp_path, family)
    ref = transformers.AutoTokenizer.from_pretrained(path)
    controller = fake_controller(tokenizer=load_tokenizer(path))
    controller.chat_template = load_chat_template(path)
    frontend = Frontend(controller)
    bos_id = ref.bos_token_id
    try:
        for messages in MESSAGES:
            expected = _ids(ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))
            body = ChatCompletionRequest.model_validate_json(json.dumps({"messages": messages}))
            (params,) = chat_job(body, frontend.chat_template).prompts
            http_ids = asyncio.run(frontend.prepare(params)).request.prompt_token_ids
            assert list(http_ids) == expected, family
            grpc_req = pb.GenerateRequest(messages=[pb.ChatMessage(**m) for m in messages])
            grpc_ids = asyncio.run(frontend.prepare(wire.params_from_proto(grpc_req, frontend.chat_template)))
            assert list(grpc_ids.request.prompt_token_ids) == expected, family
            if bos_id is not None:
                assert list(http_ids).count(bos_id) == 1 and http_ids[0] == bos_id  # exactly one, first
        # A completions prompt is the tokenizer's own encoding (special tokens on), as `tokenizer(text)`.
        (params,) = completion_job(CompletionRequest.model_validate_json('{"prompt": "Hello there"}')).prompts
        assert list(asyncio.run(frontend.prepare(params)).request.prompt_token_ids) == ref("Hello there")["input_ids"]
    finally:
        controller.shutdown(drain_timeout_s=0)
