"""The serving layer: the network front of a runtime backend, typed as `jaxserve.runtime.api.ServingController`.

* `frontend.py` — validation, tokenization, detokenized streaming, n-sample fan-out, shared by both APIs.
* `grpc_service.py` — the gRPC service (`jaxserve/proto/jaxserve.proto`); `wire.py` converts
  between its messages and the runtime's dataclasses.
* `http_api.py` — the OpenAI-compatible HTTP API; `openai_protocol.py` its request schemas;
  `chat_template.py` the chat template both APIs use; `tool_calls.py` forced tool calls (the generic format),
  `tool_parsers.py` `tool_choice: "auto"` (the template's tool-call format, parsed whole or streamed).
* `metrics.py` — Prometheus metrics (the workload gauges among them).
* `admin.py` — the operator routes' trust boundary (Bearer checks, `AdminAccess`: the admin key, never the
  API key) and what the server needs from a replanning loop (`jaxserve/tools/replan_loop.py`): gauges,
  `/debug/workload`, `POST /admin/deployment` and its body parser.
* `server.py` — one process serving both APIs over one controller.
* `start_up_signals.py` — SIGINT/SIGTERM stop `serve` at once while it loads, before `server.py`'s event loop
  handles them.
"""
