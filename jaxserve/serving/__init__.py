"""The serving layer: the network front of a runtime `Controller`.

* `frontend.py` — validation, tokenization, detokenized streaming, shared by both APIs.
* `grpc_service.py` — the gRPC service (`jaxserve/proto/jaxserve.proto`); `wire.py` converts
  between its messages and the runtime's dataclasses.
* `http_api.py` — the OpenAI-compatible HTTP API.
* `metrics.py` — Prometheus metrics.
* `server.py` — one process serving both APIs over one controller.
"""
