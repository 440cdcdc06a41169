"""Build ``optim.c`` (and ``compress.c``) into a shared library on first use, cache it, load it with ctypes.

The library is compiled with the C compiler ``$CC`` (default ``gcc``) and ``FLAGS`` into
``$DSLAUNCH_KERNELS_CACHE`` (default ``$XDG_CACHE_HOME/dslaunch/kernels``, i.e.
``~/.cache/dslaunch/kernels``), named by a hash of the source, the flags, the compiler's
``--version`` and the CPU's feature flags (``-march=native`` code runs only on such a CPU). A build
takes ~7 s here (gcc -O3, 2 cores), minutes on a machine busy with other work. One process builds
while the others that want the same library wait for it (an ``flock`` on ``<library>.lock`` in the
cache directory, released by the kernel if the builder dies). The compiler is bounded by the CPU time
it uses (``_CPU_LIMIT_S``), not by the wall clock, so a build starved by other work finishes; a
compiler that neither works nor finishes is given up after ``_WALL_LIMIT_S``. The library is written to
a temporary file in the cache directory and renamed into place, so a reader never sees half a library.

Loading a library runs its constructors, and its name is public (a hash of public inputs), so the
cache is trusted only as far as its owner: missing directories are created 0700 whatever the
umask; a library is loaded only from a directory owned by this user and writable by no one else,
only if the file too is this user's, a regular file and writable by no one else. Both are checked
on open descriptors and the library is loaded through ``/proc/self/fd``, so nothing can be swapped
in between. An untrusted directory is not used (one warning line; the library is built privately
for this process); an untrusted file in a trusted directory is rebuilt over.

Without a compiler, or when the build or the load fails, or the library lacks a kernel,
``library()`` returns None after one warning line, and the kernels dispatch point keeps the torch
reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import signal
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from dslaunch.errors import quote
from dslaunch.safe_write import lock_file
from dslaunch.utils.private_cache import Untrusted, check_owner, make_private_dirs, open_private_file

__all__ = ["CACHE_ENV", "FLAGS", "SOURCE", "EXTRA_SOURCES", "KernelBuildError", "cache_dir", "cached_path", "build", "library",
           "available"]

log = logging.getLogger("dslaunch.kernels")

CACHE_ENV = "DSLAUNCH_KERNELS_CACHE"
SOURCE = Path(__file__).with_name("optim.c")
# Compiled into the same library: the 1-bit compression kernels (the 1-bit exchange of runtime/optim/compression.py).
EXTRA_SOURCES = (Path(__file__).with_name("compress.c"),)
# -ffp-contract=off: a multiply-add is fused only where optim.c says so (fmaf, where torch's
# vectorised kernels round once), so results equal torch's bit for bit on AVX2 and stay within
# 1e-6 elsewhere. -fno-math-errno (sqrtf without errno) and -fno-trapping-math (no FP traps, so
# branches become selects) let the loops vectorise; neither changes a result. No -ffast-math: it
# would reorder sums and assume no NaN, which the overflow check relies on.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
         "-std=gnu11", "-shared", "-fPIC")
# ~17x a build's CPU time here: only a compiler that loops hits it, however busy the machine.
_CPU_LIMIT_S = 120
# A compiler blocked without computing (a stuck file system): given up long after any slow build.
_WALL_LIMIT_S = 1800


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
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=_WALL_LIMIT_S)
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


def _key(cc: str) -> str:
    sources = [path.read_bytes() for path in (SOURCE, *EXTRA_SOURCES)]
    return hashlib.sha256(b"\0".join([*sources, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                      _cpu_features().encode()])).hexdigest()[:20]


def _open_cache(folder: Path) -> int:
    """A descriptor of the cache directory, created if missing, after checking who can write it.

    Raises:
        Untrusted: the directory is another user's or writable by others.
    """
    make_private_dirs(folder)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        check_owner(fd, "the directory")
    except Untrusted:
        os.close(fd)
        raise
    return fd


def _open_library(dir_fd: int, name: str) -> int | None:
    """A descriptor of the cached library, or None when it is missing or untrusted (rebuild it)."""
    try:
        return open_private_file(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.warning("dslaunch: rebuilding the CPU kernels over %s: cannot open it (%s)", name, exc.strerror)
    except Untrusted as why:
        log.warning("dslaunch: rebuilding the CPU kernels over %s: %s", name, why)
    return None


def _compile(cc: str, dir_fd: int, name: str) -> None:
    """Compile into a temporary file of the directory ``dir_fd``, then rename it to ``name``.

    The compiler's path goes through this process's ``/proc/<pid>/fd``: the directory checked is
    the one written, whatever is renamed on the way to it.
    """
    fd, tmp = tempfile.mkstemp(prefix=name + ".", suffix=".tmp", dir=f"/proc/{os.getpid()}/fd/{dir_fd}")
    os.close(fd)
    tmp_name = os.path.basename(tmp)
    # The CPU limit through sh's ulimit, inherited by the compiler's own children (cc1, as, ld):
    # preexec_fn is not safe in a process with threads, as a training process has.
    limited = ["/bin/sh", "-c", f'ulimit -t {_CPU_LIMIT_S} && exec "$0" "$@"', cc]
    try:
        out = subprocess.run([*limited, *FLAGS, "-o", tmp, str(SOURCE), *map(str, EXTRA_SOURCES)], capture_output=True,
                             text=True, timeout=_WALL_LIMIT_S)
        if out.returncode in (-signal.SIGKILL, -signal.SIGXCPU):  # the compiler itself hit the limit
            raise KernelBuildError(f"'{cc}' used over {_CPU_LIMIT_S} s of CPU building {SOURCE.name}")
        if out.returncode != 0:
            first = next((ln for ln in out.stderr.splitlines() if "error" in ln), out.stderr.strip()[:200])
            raise KernelBuildError(f"'{cc}' failed to build {SOURCE.name} (exit {out.returncode}): {first}")
        # The linker creates its output 0777 & ~umask: with umask 000 others could rewrite it.
        os.chmod(tmp_name, 0o700, dir_fd=dir_fd)
        # atomic: concurrent builders each rename a complete file
        os.replace(tmp_name, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except subprocess.TimeoutExpired:
        raise KernelBuildError(f"'{cc}' did not finish building {SOURCE.name} in {_WALL_LIMIT_S} s") from None
    finally:
        try:
            os.unlink(tmp_name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


@contextlib.contextmanager
def _build_lock(dir_fd: int, name: str, private: bool) -> Iterator[None]:
    """Hold ``<name>.lock`` in the cache directory ``dir_fd`` (waiting while another process builds);
    none in a private directory, which only this process uses, nor where the lock cannot be made (a
    read-only cache: nothing can be built into it, and a library there is still loaded)."""
    try:
        fd = None if private else lock_file(dir_fd, f"{name}.lock")
    except OSError:
        fd = None
    if fd is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released at close, or by the kernel when a builder dies
        yield
    finally:
        os.close(fd)


def _library_name(cc: str) -> str:
    return f"dslaunch_cpu_optim-{_key(cc)}.so"


def cached_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the library for this source, compiler and CPU is (or would be) cached; builds nothing.

    Raises:
        KernelBuildError: no usable compiler (the name depends on its version).
    """
    return cache_dir(environ) / _library_name(_compiler(environ))


def _build_fd(environ: Mapping[str, str]) -> tuple[Path, int]:
    """The library's path and an open descriptor of it, trusted, compiling it first if needed."""
    cc = _compiler(environ)
    name = _library_name(cc)
    folder = cache_dir(environ)
    private = False
    try:
        dir_fd = _open_cache(folder)
    except Untrusted as why:
        log.warning("dslaunch: kernel cache %s not used: %s; building the CPU kernels privately for this "
                    "process (use a directory of yours that only you can write, or unset %s)",
                    quote(str(folder), 200), why, CACHE_ENV)
        folder, private = Path(tempfile.mkdtemp(prefix="dslaunch-kernels-")), True  # mkdtemp: 0700
        dir_fd = _open_cache(folder)
    try:
        with _build_lock(dir_fd, name, private):  # a process that waited here finds the build done
            fd = _open_library(dir_fd, name)
            if fd is None:
                _compile(cc, dir_fd, name)
                fd = _open_library(dir_fd, name)
        if fd is None:
            raise KernelBuildError(f"the library built in {folder} could not be opened")
        if private:  # the descriptor keeps the library; nothing is left behind
            os.unlink(name, dir_fd=dir_fd)
            os.rmdir(folder)
    finally:
        os.close(dir_fd)
    return folder / name, fd


def build(environ: Mapping[str, str] = os.environ) -> Path:
    """The path of the built library, compiling it first unless the cache has a trusted one.

    Raises:
        KernelBuildError: no compiler, or the compilation failed (first line of its output).
    """
    path, fd = _build_fd(environ)
    os.close(fd)
    return path


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The loaded kernel library, built on first call; None (after one warning line) if it cannot be."""
    try:
        path, fd = _build_fd(os.environ)
        try:
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")  # the very file checked, not whatever is at path now
        finally:
            os.close(fd)
        _declare(lib)
    except (KernelBuildError, OSError) as exc:
        log.warning("dslaunch: CPU kernels unavailable, using the torch reference: %s", exc)
        return None
    except AttributeError as exc:  # ctypes: a symbol the library lacks
        log.warning("dslaunch: CPU kernels unavailable, using the torch reference: %s lacks a kernel (%s)",
                    path, exc)
        return None
    return lib


def available() -> bool:
    """Whether the CPU kernels run in this process (the dispatch point's ``available`` check)."""
    return library() is not None


def _declare(lib: ctypes.CDLL) -> None:
    """The C signatures (ctypes would otherwise pass every float as an int)."""
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    rows = [p, i64, i32, i32]  # the row table (an address), its length, gdt, odt
    signatures = {
        "dsl_adam": (rows + [f32] * 13 + [i32, i32, i32], None),
        "dsl_adagrad": (rows + [f32] * 5 + [i32], None),
        "dsl_lion": (rows + [f32] * 5 + [i32], None),
        "dsl_grad_sumsq": ([p, i32, i64, f32, i32], ctypes.c_double),
        "dsl_fold_sumsq": ([p, p, i32, i64, i32, i32], ctypes.c_double),
        "dsl_copy_out": ([p, p, i32, i64, i32], None),
        "dsl_advise_huge": ([p, i64], ctypes.c_int),
        "dsl_stream": (rows + [i32], None),
        "dsl_stream_read": ([p, i32, i64, i32], ctypes.c_double),
        "dsl_onebit_pack": ([p, p, p, i64, i64, i64, f32, i32], None),
        "dsl_onebit_unpack": ([p, i64, i64, i64, p, i32, i32], None),
    }
    for name, (argtypes, restype) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
