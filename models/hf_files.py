"""Hugging Face checkpoint files as lazily read arrays: safetensors (memory-mapped; a file cut short is a
`CheckpointError` before any read), `pytorch_model.bin`, and sharded indexes of either.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from models.config import CheckpointError

_SAFETENSORS_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _open_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Memory-map every tensor of a .safetensors file (header: u64 length + JSON; then raw data).

    A file cut short (in the header or in any tensor's data) is a `CheckpointError` here, before
    a memory map would fault on the missing bytes at first read.
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header length)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(f"{path}: truncated safetensors file: header of {header_len} bytes, file {size}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from e
    base = 8 + header_len
    out: dict[str, np.ndarray] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(meta["dtype"])
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {meta['dtype']}")
        shape = tuple(meta["shape"])
        start, end = meta["data_offsets"]
        if end - start != int(np.prod(shape)) * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{path}: tensor {name} spans {end - start} bytes, its shape {shape} needs more")
        if base + end > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: tensor {name} ends at byte {base + end}, file has {size}"
            )
        if int(np.prod(shape)) == 0:
            out[name] = np.zeros(shape, dtype)
        else:
            out[name] = np.memmap(path, dtype=dtype, mode="r", offset=base + start, shape=shape)
    return out


def _open_torch(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a test dependency
        raise CheckpointError(f"{path}: reading pytorch_model.bin needs torch, which is not installed") from e
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    out: dict[str, np.ndarray] = {}
    for name, t in state.items():
        t = t.detach()
        if t.dtype == torch.bfloat16:
            out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        else:
            out[name] = t.numpy()
    return out


def open_hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    """All tensors of a HF checkpoint dir as lazily-read arrays (safetensors, sharded or not; torch .bin)."""
    files: list[Path]
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = directory / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({directory / f for f in weight_map.values()})
            break
    else:
        files = [p for p in (directory / "model.safetensors", directory / "pytorch_model.bin") if p.exists()][:1]
    if not files:
        raise CheckpointError(f"{directory}: no model.safetensors, sharded index or pytorch_model.bin found")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{directory}: index names {f.name}, which does not exist")
        tensors.update(_open_safetensors(f) if f.suffix == ".safetensors" else _open_torch(f))
    return tensors


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").exists() and any(
        (path / n).exists()
        for n in (
            "model.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "pytorch_model.bin.index.json",
        )
    )
