from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class GenerateRequest(_message.Message):
    __slots__ = ("ignore_eos", "max_tokens", "prompt", "prompt_token_ids", "seed", "stop", "stop_token_ids", "temperature", "top_k", "top_p")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    def __init__(self, prompt: str | None = ..., prompt_token_ids: _Iterable[int] | None = ..., max_tokens: int | None = ..., temperature: float | None = ..., top_p: float | None = ..., top_k: int | None = ..., seed: int | None = ..., stop_token_ids: _Iterable[int] | None = ..., stop: _Iterable[str] | None = ..., ignore_eos: bool | None = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("finish_reason", "request_id", "text", "timings", "token_ids", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    timings: RequestTimings
    usage: Usage
    def __init__(self, request_id: str | None = ..., token_ids: _Iterable[int] | None = ..., text: str | None = ..., finish_reason: FinishReason | str | None = ..., timings: RequestTimings | _Mapping | None = ..., usage: Usage | _Mapping | None = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("completion_tokens", "prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: int | None = ..., completion_tokens: int | None = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("decode_instance", "decode_queue_s", "e2e_s", "kv_transfer_bytes", "kv_transfer_s", "prefill_instance", "prefill_queue_s", "prefill_s", "token_times_s", "tpot_s", "ttft_s")
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TPOT_S_FIELD_NUMBER: _ClassVar[int]
    E2E_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_TIMES_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    ttft_s: float
    tpot_s: float
    e2e_s: float
    prefill_queue_s: float
    prefill_s: float
    kv_transfer_s: float
    decode_queue_s: float
    kv_transfer_bytes: int
    token_times_s: _containers.RepeatedScalarFieldContainer[float]
    prefill_instance: str
    decode_instance: str
    def __init__(self, ttft_s: float | None = ..., tpot_s: float | None = ..., e2e_s: float | None = ..., prefill_queue_s: float | None = ..., prefill_s: float | None = ..., kv_transfer_s: float | None = ..., decode_queue_s: float | None = ..., kv_transfer_bytes: int | None = ..., token_times_s: _Iterable[float] | None = ..., prefill_instance: str | None = ..., decode_instance: str | None = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("bos_token_id", "dtype", "eos_token_id", "ffn_dim", "has_tokenizer", "hidden_size", "max_position_embeddings", "max_prompt_tokens", "max_tokens_limit", "name", "num_heads", "num_layers", "vocab_size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    FFN_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    name: str
    vocab_size: int
    max_position_embeddings: int
    hidden_size: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    dtype: str
    has_tokenizer: bool
    bos_token_id: int
    eos_token_id: int
    max_prompt_tokens: int
    max_tokens_limit: int
    def __init__(self, name: str | None = ..., vocab_size: int | None = ..., max_position_embeddings: int | None = ..., hidden_size: int | None = ..., num_layers: int | None = ..., num_heads: int | None = ..., ffn_dim: int | None = ..., dtype: str | None = ..., has_tokenizer: bool | None = ..., bos_token_id: int | None = ..., eos_token_id: int | None = ..., max_prompt_tokens: int | None = ..., max_tokens_limit: int | None = ...) -> None: ...

class GetDeploymentRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Instance(_message.Message):
    __slots__ = ("chunk_size", "devices", "name", "pp", "role", "tp")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    tp: int
    pp: int
    devices: _containers.RepeatedScalarFieldContainer[int]
    chunk_size: int
    def __init__(self, name: str | None = ..., role: str | None = ..., tp: int | None = ..., pp: int | None = ..., devices: _Iterable[int] | None = ..., chunk_size: int | None = ...) -> None: ...

class Deployment(_message.Message):
    __slots__ = ("instances", "kind", "plan_json", "spec")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    plan_json: str
    def __init__(self, kind: str | None = ..., spec: str | None = ..., instances: _Iterable[Instance | _Mapping] | None = ..., plan_json: str | None = ...) -> None: ...
