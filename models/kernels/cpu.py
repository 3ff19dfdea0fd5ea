"""Build, cache and register the CPU kernels (`paged_attention_cpu.cc`; `quant_matmul_cpu.cc`, see
`quant_matmul_target`) as XLA FFI targets.

The kernel is C++ against the XLA FFI headers that jaxlib ships (`jax.ffi.include_dir()`), compiled
once per machine with the system's C++ compiler (`$CXX`, else `c++` / `g++`) and `-march=native`, into
a cache folder (`$JAXSERVE_KERNEL_CACHE`, else `$XDG_CACHE_HOME/jaxserve/kernels`, else
`~/.cache/jaxserve/kernels`). The library's name carries a hash of the source, the compiler's version,
the flags, jaxlib's version and the CPU's feature flags, so a change to any of them builds a new one
and a cache shared between machines never hands one a library built for another's instructions.
Builds write to a temporary name and rename, so processes starting together (Ray workers) may race.

`paged_attention_target()` returns the registered target's name, or None when the kernel cannot be
had here (no compiler, a failed build, not the CPU backend, or `JAXSERVE_CPU_KERNEL=0`); `build_error()`
then says why. Callers fall back to the XLA forms: the kernel is a speed-up, never a requirement.

A fresh machine's build takes seconds (`-O3` C++ on one core). `start_build()` runs the compiler on a thread
(a process of its own: another core) from the start of a process that will want the kernel, beside its
imports, weight loading and XLA compiles; `paged_attention_target()` waits for that build where the kernel is
first needed (a paged step's trace), and `may_have_kernel()` answers without waiting (`default_impl(wait=False)`).

Two variants of the one source: the release kernel clamps out-of-range block ids, lengths and the layer
index into the pool (no check on the serving path); the checked kernel (`-DJAXSERVE_KERNEL_CHECKS`, its
own library, cache key and FFI target) fails the call with an error that names the bad block id / length
instead. `JAXSERVE_KERNEL_CHECKS=1` selects the checked one (the test suite's conftest sets it); it is read
when a call is traced, so a program compiled before a change keeps the variant it was traced with.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import Future
from pathlib import Path

from models.kernels.trust import ensure_private_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_attention_cpu.cc")
TARGET = "jaxserve_paged_attention_cpu"
CHECKED_TARGET = "jaxserve_paged_attention_cpu_checked"
_SYMBOL = "JaxservePagedAttention"
QUANT_SOURCE = Path(__file__).with_name("quant_matmul_cpu.cc")
QUANT_TARGET = "jaxserve_quant_matmul_cpu"
_QUANT_SYMBOL = "JaxserveQuantMatmul"
# the same library's second handler: a quantized weight dequantized to float32 (what a prefill multiplies by)
DEQUANT_TARGET = "jaxserve_quant_dequantize_cpu"
_DEQUANT_SYMBOL = "JaxserveQuantDequantize"
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")
_NATIVE = ("-march=native",)
_CHECKS = ("-DJAXSERVE_KERNEL_CHECKS=1",)
BUILD_TIMEOUT_S = 300.0

_lock = threading.Lock()
_state: dict[bool, tuple[str | None, str]] = {}  # checked -> (target or None, error) once tried
_libs: list[ctypes.CDLL] = []  # loaded libraries stay referenced for the process's life
_registered: set[str] = set()  # targets registered with XLA in this process (a name registers once)
_quant_state: list[tuple[str | None, str]] = []  # the quantized-matmul kernel's (target or None, error) once tried
# checked -> (compiler, the library it is building): started by `start_build`, taken by `paged_attention_target`
_pending: dict[bool, tuple[str, Future[Path]]] = {}
_pending_lock = threading.Lock()  # not `_lock`, which a caller holds while it waits for the build


def cache_dir() -> Path:
    if env := os.environ.get("JAXSERVE_KERNEL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "jaxserve" / "kernels"


def compiler() -> str | None:
    """The C++ compiler to build with: `$CXX`, else the first of c++ / g++ / clang++ on PATH."""
    if env := os.environ.get("CXX"):
        return env
    for name in ("c++", "g++", "clang++"):
        if found := shutil.which(name):
            return found
    return None


def enabled() -> bool:
    """False when `JAXSERVE_CPU_KERNEL` is 0 / false / no / off (the XLA forms then serve)."""
    return os.environ.get("JAXSERVE_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "no", "off")


def checks_enabled() -> bool:
    """True when `JAXSERVE_KERNEL_CHECKS` is 1 / true / yes / on: calls use the checked kernel."""
    return os.environ.get("JAXSERVE_KERNEL_CHECKS", "0").strip().lower() in ("1", "true", "yes", "on")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(
    cxx: str,
    include: str,
    jaxlib_version: str,
    checked: bool = False,
    source_path: Path | None = None,
    isa: tuple[str, ...] | None = None,
) -> Path:
    """The library for this source (default: the paged-attention kernel's), compiler, flags (the checked variant's
    define among them), jaxlib and CPU. `isa`: instruction-set flags in place of -march=native (a test builds
    the AVX2 and plain variants of a kernel this way)."""
    source_path = SOURCE if source_path is None else source_path
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    source = source_path.read_bytes()
    last_error = ""
    for extra in (_NATIVE, ()) if isa is None else (isa,):  # -march=native where the compiler knows it, else baseline
        flags = (*_FLAGS, *(_CHECKS if checked else ()), *extra)
        key = hashlib.sha256(
            b"\0".join(
                x.encode() if isinstance(x, str) else x
                for x in (source, version, " ".join(flags), jaxlib_version, platform.machine(), _cpu_features())
            )
        ).hexdigest()[:20]
        folder = ensure_private_dir(cache_dir(), "the CPU kernel cache ($JAXSERVE_KERNEL_CACHE)")
        lib = folder / f"{source_path.stem}{'-checked' if checked else ''}-{key}.so"
        if lib.exists():
            return lib
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.name, suffix=".tmp", dir=folder)
        os.close(fd)
        cmd = [cxx, *flags, f"-I{include}", str(source_path), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode == 0:
            os.replace(tmp, lib)
            log.info("built the CPU kernel %s: %s", source_path.name, lib)
            return lib
        Path(tmp).unlink(missing_ok=True)
        last_error = f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
    raise RuntimeError(last_error)


def _jaxlib() -> tuple[str, str]:
    """(jaxlib's header folder, as `jax.ffi.include_dir()` says, and its version) without importing JAX."""
    import jaxlib

    if jaxlib.__file__ is not None:
        folder = os.path.dirname(os.path.abspath(jaxlib.__file__))
    else:  # a namespace package
        folder = next(iter(jaxlib.__path__))
    return os.path.join(folder, "include"), jaxlib.__version__


def start_build(checked: bool | None = None) -> None:
    """Build the kernel's library on a daemon thread, so the compiler runs beside what the process does next;
    `paged_attention_target()` waits for it. Nothing when it is disabled, there is no compiler, or it was
    built (or started) already. Imports no JAX: a start-up calls it first thing."""
    checked = checks_enabled() if checked is None else checked
    with _pending_lock:
        if checked in _state or checked in _pending or not enabled() or (cxx := compiler()) is None:
            return
        future: Future[Path] = Future()
        _pending[checked] = (cxx, future)

    def build() -> None:
        try:
            future.set_result(_build(cxx, *_jaxlib(), checked))
        except BaseException as e:  # handed to whoever takes the build (`paged_attention_target`)
            future.set_exception(e)

    threading.Thread(target=build, name="jaxserve-kernel-build", daemon=True).start()


def may_have_kernel(checked: bool | None = None) -> bool:
    """Without waiting: True when the kernel is registered, or may be (enabled, a compiler here, and no build
    of it failed yet); starts its build (`start_build`) if none ran. `paged_attention_target()` is the answer."""
    checked = checks_enabled() if checked is None else checked
    if checked in _state:
        return _state[checked][0] is not None
    if not enabled() or compiler() is None:
        return False
    start_build(checked)
    return True


def only_cpu_expected() -> bool:
    """Whether JAX will run on the CPU here, judged without importing it: `JAX_PLATFORMS` says cpu, or no
    accelerator plugin (CUDA, ROCm, TPU) is installed. A start-up builds the CPU kernel early only then."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms.split(",")[0] == "cpu"
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
    return not any(importlib.util.find_spec(name) is not None for name in plugins)


def _compiler_or_why_not() -> tuple[str | None, str]:
    """(the C++ compiler, '') when a kernel may be built here, else (None, why not)."""
    if not enabled():
        return None, "disabled by JAXSERVE_CPU_KERNEL"
    if (cxx := compiler()) is None:
        return None, "no C++ compiler found (set CXX, or install g++)"
    return cxx, ""


def _register(name: str, lib_path: Path, symbol: str) -> None:
    """Load the library (kept for the process's life) and register its handler `symbol` as XLA:CPU target `name`."""
    import jax

    lib = ctypes.cdll.LoadLibrary(str(lib_path))
    _libs.append(lib)
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    _registered.add(name)


def paged_attention_target(checked: bool | None = None) -> str | None:
    """The FFI target name of the CPU kernel, building and registering it on first use; None if unavailable.

    `checked`: the variant that raises on out-of-range indices (default: `checks_enabled()`).
    """
    checked = checks_enabled() if checked is None else checked
    with _lock:
        if checked in _state:
            return _state[checked][0]
        name = CHECKED_TARGET if checked else TARGET
        target: str | None = None
        error = ""
        try:
            cxx, error = _compiler_or_why_not()
            if cxx is not None:
                if name not in _registered:
                    with _pending_lock:
                        started = _pending.get(checked)  # dropped once `_state` has the outcome
                    if started is not None and started[0] == cxx:  # `start_build`'s: wait for it
                        lib_path = started[1].result()
                    else:
                        lib_path = _build(cxx, *_jaxlib(), checked)
                    _register(name, lib_path, _SYMBOL)
                target = name
        except Exception as e:  # a speed-up that failed to build: serve with the XLA forms, say why once
            error = f"{type(e).__name__}: {e}"
        if target is None:
            log.warning("CPU paged-attention kernel unavailable, using the XLA form: %s", error)
        _state[checked] = (target, error)
        with _pending_lock:
            _pending.pop(checked, None)
        return target


def build_error(checked: bool | None = None) -> str:
    """Why `paged_attention_target(checked)` returned None ('' before it ran or when it succeeded)."""
    tried = _state.get(checks_enabled() if checked is None else checked)
    return tried[1] if tried else ""


def quant_matmul_target() -> str | None:
    """The FFI target of the quantized-matmul kernel (`quant_matmul_cpu.cc`, `models.quant`), built and registered
    on first use (no checked variant: it reads no indices); None if unavailable, `quant_build_error()` says why."""
    with _lock:
        if _quant_state:
            return _quant_state[0][0]
        target: str | None = None
        error = ""
        try:
            cxx, error = _compiler_or_why_not()
            if cxx is not None:
                if QUANT_TARGET not in _registered:
                    lib_path = _build(cxx, *_jaxlib(), source_path=QUANT_SOURCE)
                    _register(QUANT_TARGET, lib_path, _QUANT_SYMBOL)
                    _register(DEQUANT_TARGET, lib_path, _DEQUANT_SYMBOL)
                target = QUANT_TARGET
        except Exception as e:  # a speed-up that failed to build: the XLA form serves
            error = f"{type(e).__name__}: {e}"
        if target is None:
            log.warning("CPU quantized-matmul kernel unavailable, using the XLA form: %s", error)
        _quant_state.append((target, error))
        return target


def int8_activations_supported() -> bool:
    """True where the quantized-matmul kernel runs `activations="int8"` as asked (AVX512-VNNI + BW, which the
    -march=native build then uses); elsewhere such a call runs the float32 form."""
    flags = _cpu_features().split()
    return quant_matmul_target() is not None and "avx512_vnni" in flags and "avx512bw" in flags


def dequantize_target() -> str | None:
    """The FFI target that dequantizes a quantized weight to float32 (`quant_matmul_cpu.cc`'s second handler,
    registered with the matmul's); None where the matmul kernel is unavailable."""
    return DEQUANT_TARGET if quant_matmul_target() is not None else None


def quant_build_error() -> str:
    """Why `quant_matmul_target()` returned None ('' before it ran or when it succeeded)."""
    return _quant_state[0][1] if _quant_state else ""


def _reset_for_tests() -> None:
    """Forget the last attempt, so the next call tries again (the registered target stays registered)."""
    with _lock:
        _state.clear()
        _quant_state.clear()
        with _pending_lock:
            _pending.clear()
