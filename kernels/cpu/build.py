"""Build ``optim.c`` into a shared library on first use, cache it, load it with ctypes.

The library is compiled with the C compiler ``$CC`` (default ``gcc``) and ``FLAGS`` into
``$DSLAUNCH_KERNELS_CACHE`` (default ``$XDG_CACHE_HOME/dslaunch/kernels``, i.e.
``~/.cache/dslaunch/kernels``), named by a hash of the source, the flags, the compiler's
``--version`` and the CPU's feature flags (``-march=native`` code runs only on such a CPU). A build
takes ~0.3 s. It is written to a temporary file in the cache directory and renamed into place, so
ranks that build at once each produce a complete file and the last rename wins; a reader never
sees half a library.

Without a compiler, or when the build or the load fails, ``library()`` returns None after one
warning line, and the kernels dispatch point keeps the torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CACHE_ENV", "FLAGS", "SOURCE", "KernelBuildError", "cache_dir", "build", "library", "available"]

log = logging.getLogger("dslaunch.kernels")

CACHE_ENV = "DSLAUNCH_KERNELS_CACHE"
SOURCE = Path(__file__).with_name("optim.c")
# -ffp-contract=off: a multiply-add is fused only where optim.c says so (fmaf, where torch's
# vectorised kernels round once), so results equal torch's bit for bit on AVX2 and stay within
# 1e-6 elsewhere. -fno-math-errno (sqrtf without errno) and -fno-trapping-math (no FP traps, so
# branches become selects) let the loops vectorise; neither changes a result. No -ffast-math: it
# would reorder sums and assume no NaN, which the overflow check relies on.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
         "-std=gnu11", "-shared", "-fPIC")
_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """The compiler is missing or failed; the message is one line saying which and why."""


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where built libraries are kept: ``$DSLAUNCH_KERNELS_CACHE``, else the user's cache dir."""
    if environ.get(CACHE_ENV):
        return Path(environ[CACHE_ENV])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dslaunch" / "kernels"


def _compiler(environ: Mapping[str, str]) -> str:
    return environ.get("CC") or "gcc"


def _compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=_TIMEOUT_S)
    except FileNotFoundError:
        raise KernelBuildError(f"C compiler {cc!r} not found; set CC to a C compiler") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"C compiler {cc!r} not usable ({type(exc).__name__}); set CC") from None
    if out.returncode != 0:
        raise KernelBuildError(f"'{cc} --version' exited with {out.returncode}; set CC to a C compiler")
    return out.stdout


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def build(environ: Mapping[str, str] = os.environ) -> Path:
    """The path of the built library, compiling it first unless the cache has it.

    Raises:
        KernelBuildError: no compiler, or the compilation failed (first line of its output).
    """
    cc = _compiler(environ)
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                     _cpu_features().encode()])).hexdigest()[:20]
    folder = cache_dir(environ)
    target = folder / f"dslaunch_cpu_optim-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        out = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                             timeout=_TIMEOUT_S)
        if out.returncode != 0:
            first = next((ln for ln in out.stderr.splitlines() if "error" in ln), out.stderr.strip()[:200])
            raise KernelBuildError(f"'{cc}' failed to build {SOURCE.name} (exit {out.returncode}): {first}")
        os.replace(tmp, target)  # atomic: concurrent builders each rename a complete file
    except subprocess.TimeoutExpired:
        raise KernelBuildError(f"'{cc}' took over {_TIMEOUT_S} s to build {SOURCE.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (after one warning line) if it cannot be."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (KernelBuildError, OSError) as exc:
        log.warning("dslaunch: CPU kernels unavailable, using the torch reference: %s", exc)
        return None
    _declare(lib)
    return lib


def available() -> bool:
    """Whether the CPU kernels run in this process (the dispatch point's ``available`` check)."""
    return library() is not None


def _declare(lib: ctypes.CDLL) -> None:
    """The C signatures (ctypes would otherwise pass every float as an int)."""
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    rows = [p, i64, i32, i32]  # the row table (an address), its length, gdt, odt
    signatures = {
        "dsl_adam": (rows + [f32] * 10 + [i32, i32], None),
        "dsl_adagrad": (rows + [f32] * 5 + [i32], None),
        "dsl_lion": (rows + [f32] * 5 + [i32], None),
        "dsl_grad_sumsq": ([p, i32, i64, f32, i32], ctypes.c_double),
        "dsl_copy_out": ([p, p, i32, i64, i32], None),
        "dsl_stream": (rows + [i32], None),
        "dsl_stream_read": ([p, i32, i64, i32], ctypes.c_double),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
