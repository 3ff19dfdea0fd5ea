"""Frozen dataclasses that are JAX pytrees (the caches and KV records passed in and out of jitted steps).

`jax.tree_util.register_dataclass` does the registration; this module only marks which fields are
static (part of the tree's structure, so a jitted function compiles per value) and keeps the classes
frozen. It replaces `flax.struct.dataclass`, whose import (all of `flax.linen`) cost every server and
worker ~0.17 s of start-up for these few classes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, dataclass_transform

import jax

_T = TypeVar("_T")


def static_field(**kwargs: Any) -> Any:
    """A field that is tree structure, not a leaf (jit compiles once per value it takes)."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field, static_field))
def pytree_dataclass(cls: type[_T]) -> type[_T]:
    """`cls` as a frozen dataclass registered as a pytree: its fields are leaves unless `static_field()`."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return jax.tree_util.register_dataclass(
        cls,
        data_fields=[f.name for f in fields if not f.metadata.get("static")],
        meta_fields=[f.name for f in fields if f.metadata.get("static")],
    )
