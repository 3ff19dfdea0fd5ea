"""jaxserve: disaggregated prefill/decode LLM serving on JAX.

Heavy pieces (the engine, JAX) load lazily, so `import jaxserve.core.plan` or the
planner never starts an accelerator runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "jaxserve.llm",
    "SamplingParams": "jaxserve.core.request",
    "GuidedSpec": "jaxserve.core.request",
}

if TYPE_CHECKING:
    from jaxserve.core.request import GuidedSpec, SamplingParams
    from jaxserve.llm import LLM


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")


__all__ = ["LLM", "GuidedSpec", "SamplingParams", "__version__"]
