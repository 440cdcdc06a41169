"""Building and loading the C kernels: the cache, concurrent builders, the fallback to torch.

A build takes ~7 s on an idle machine and minutes on a busy one: a test waits for its builds to
end, as the user's job would, and only pytest-timeout (``BUILDS``) bounds it. The probes (a new
process importing the kernels) are forked with torch already imported (``run_python``): a new
interpreter spends seconds on importing torch and shutting down, which no test here is about.
The tests of what happens around a compile (the lock, the cache's trust, the file modes) compile through
``fast_cc``: gcc's name and version, the library built once for the module written as a linker
writes its output; ``test_the_cache_key...`` and ``test_ops`` compile with gcc itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslaunch.kernels.cpu import build
from tests.distributed import run_python

HAVE_CC = build.available()
# Holds a few builds and torch imports on 2 cores at load 10 (~40 s each there, ~8 s idle).
BUILDS = pytest.mark.timeout(600)

_PROBE = """
import torch
from dslaunch import kernels
from dslaunch.kernels.cpu import build
impl = kernels.get("torch.adamw", "cpu")
print("IMPL", impl.__module__, build.build().name if build.available() else "-")
p = torch.nn.Parameter(torch.ones(3)); p.grad = torch.ones(3)
from dslaunch.runtime.optim.torch_optimizers import AdamW  # the engine's AdamW: it dispatches
opt = AdamW([p], lr=0.1, weight_decay=0.0); opt.step(); opt.step()
print("PARAM", round(float(p[0].detach()), 6))
"""


@pytest.fixture(scope="module")
def fast_cc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compiler that answers ``--version`` as gcc (so the library keeps its name) and writes the
    library built once with gcc into ``-o`` as the linker does (created ``0666 & ~umask``), in
    milliseconds instead of a ~7-40 s ``-O3`` build per test."""
    folder = tmp_path_factory.mktemp("fast-cc")
    try:
        built = build.build()  # the user's cache, as every kernel test: built once per machine
    except build.KernelBuildError:
        built = folder / "-"
    if not built.is_file():  # an unusable cache (a private build leaves no file): one build here
        built = build.build({**os.environ, build.CACHE_ENV: str(folder / "cache")})
    cc = folder / "cc"
    cc.write_text('#!/bin/sh\n[ "$1" = --version ] && exec gcc --version\n'
                  'while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\n'
                  f'rm -f "$out" && cat {built} > "$out"\n')
    cc.chmod(0o755)
    return cc


def _probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return run_python(_PROBE, {**os.environ, build.CACHE_ENV: str(tmp_path / "cache"), **env})[0]


def test_without_a_compiler_the_reference_runs_and_says_so_once(tmp_path: Path) -> None:
    out = _probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert out.returncode == 0, out.stderr
    assert "IMPL dslaunch.kernels.reference -" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CPU kernels unavailable, using the torch reference" in lines[0]
    assert "no-such-cc" in lines[0]
    assert "PARAM 0.8" in out.stdout  # two AdamW steps of 0.1 on a constant gradient


def test_a_compiler_that_fails_falls_back(tmp_path: Path) -> None:
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fakecc 1.0; exit 0; }\necho 'error: no' >&2; exit 3\n")
    fake.chmod(0o755)
    out = _probe(tmp_path, CC=str(fake))
    assert out.returncode == 0 and "IMPL dslaunch.kernels.reference" in out.stdout
    assert "failed to build optim.c (exit 3): error: no" in out.stderr
    assert not list((tmp_path / "cache").glob("*.tmp"))  # the failed build left nothing


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@BUILDS
def test_concurrent_builders_wait_for_one_build(tmp_path: Path, fast_cc: Path) -> None:
    compiles, cc = tmp_path / "compiles", tmp_path / "cc"
    # Each process asks the version (the library's name) just before it takes the build lock: the
    # build goes on once both have, so the second one surely finds it under way and waits.
    asked = tmp_path / "asked"
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo $PPID >> {asked}; exec gcc --version; }}\n'
                  f'echo build >> {compiles}\n'
                  f'for i in $(seq 600); do [ $(sort -u {asked} | wc -l) -ge 2 ] && break; sleep 0.1; done\n'
                  f'sleep 0.5\nexec {fast_cc} "$@"\n')
    cc.chmod(0o755)
    env = {**os.environ, build.CACHE_ENV: str(tmp_path / "cache"), "CC": str(cc)}
    procs = run_python(_PROBE, env, copies=2)
    assert all(p.returncode == 0 for p in procs), [p.stderr for p in procs]
    names = {ln.split()[-1] for p in procs for ln in p.stdout.splitlines() if ln.startswith("IMPL")}
    assert all("IMPL dslaunch.kernels.cpu.torch_steps" in p.stdout for p in procs)
    assert len(names) == 1 and "PARAM 0.8" in procs[0].stdout
    assert compiles.read_text() == "build\n"  # the second process waited for the first one's build
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    (name,) = names
    assert files == [name, f"{name}.lock"]  # one library and its lock, no temporary files left


def test_a_compiler_is_bounded_by_the_cpu_time_it_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = tmp_path / "cc"  # a compiler that loops
    cc.write_text(f'#!/bin/sh\n[ "$1" = --version ] && {{ echo loopcc 1.0; exit 0; }}\n'
                  f'exec {sys.executable} -c "while True: pass"\n')
    cc.chmod(0o755)
    monkeypatch.setattr(build, "_CPU_LIMIT_S", 1)
    with pytest.raises(build.KernelBuildError, match=r"used over 1 s of CPU building optim.c"):
        build.build({**os.environ, build.CACHE_ENV: str(tmp_path / "cache"), "CC": str(cc)})
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@BUILDS
def test_the_cache_key_follows_the_source_and_the_compiler_and_cached_path_names_the_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's lookup (``cached_path``) builds nothing and names the file ``build`` writes, so
    the other keys are checked on names (each build costs seconds)."""
    env = {**os.environ, build.CACHE_ENV: str(tmp_path / "cache")}
    first = build.cached_path(env)
    assert not first.exists()
    assert build.build(env) == first and first.is_file() and build.build(env) == first
    with pytest.raises(build.KernelBuildError, match="not found"):
        build.cached_path({**env, "CC": str(tmp_path / "no-cc")})
    wrapper = tmp_path / "cc"
    wrapper.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo other-version\nexec gcc \"$@\"\n")
    wrapper.chmod(0o755)
    assert build.cached_path({**env, "CC": str(wrapper)}) != first
    src = tmp_path / "optim.c"
    src.write_text(build.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(build, "SOURCE", src)
    assert build.cached_path(env) != first


def test_the_default_cache_dir() -> None:
    assert build.cache_dir({"HOME": "/h"}) == Path(os.path.expanduser("~")) / ".cache/dslaunch/kernels"
    assert build.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/dslaunch/kernels")
    assert build.cache_dir({build.CACHE_ENV: "/k", "XDG_CACHE_HOME": "/x"}) == Path("/k")


_PLANTED = '#include <stdlib.h>\n__attribute__((constructor)) static void planted(void) { system("touch %s"); }\n'


def _plant(path: Path, marker: Path, source: str = _PLANTED) -> None:
    """A library at ``path`` whose constructor creates ``marker`` when it is loaded."""
    src = path.parent / "planted.c"
    src.write_text(source % marker if "%s" in source else source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(path), str(src)], check=True)
    src.unlink()


def _library_name(tmp_path: Path) -> str:
    # the name a build would give (test_cached_path_names... checks that it is): no build needed
    return build.cached_path({**os.environ, build.CACHE_ENV: str(tmp_path / "reference-cache")}).name


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@BUILDS
def test_under_umask_000_the_cache_and_the_library_are_private(tmp_path: Path, fast_cc: Path) -> None:
    cache = tmp_path / "a" / "b" / "cache"
    (out,) = run_python(_PROBE, {**os.environ, build.CACHE_ENV: str(cache), "CC": str(fast_cc)}, umask=0)
    assert out.returncode == 0 and "IMPL dslaunch.kernels.cpu.torch_steps" in out.stdout, out.stderr
    for folder in (tmp_path / "a", tmp_path / "a" / "b", cache):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    lib, lock = sorted(cache.iterdir())
    assert lock.name == f"{lib.name}.lock"
    assert lib.stat().st_mode & 0o022 == 0 and lock.stat().st_mode & 0o077 == 0


@pytest.mark.skipif(not HAVE_CC or os.geteuid() != 0, reason="needs a C compiler and root (chown)")
@BUILDS
def test_a_library_planted_in_a_cache_of_another_user_never_runs(tmp_path: Path, fast_cc: Path) -> None:
    shared, marker, private_tmp = tmp_path / "shared", tmp_path / "ran-as-root", tmp_path / "tmp"
    shared.mkdir()
    private_tmp.mkdir()
    _plant(shared / _library_name(tmp_path), marker)
    for path in (shared, *shared.iterdir()):
        os.chown(path, 65534, 65534)  # user nobody, as in the issue
        path.chmod(0o777)
    out = _probe(tmp_path, **{build.CACHE_ENV: str(shared), "TMPDIR": str(private_tmp), "CC": str(fast_cc)})
    assert out.returncode == 0 and "IMPL dslaunch.kernels.cpu.torch_steps" in out.stdout, out.stderr
    assert "PARAM 0.8" in out.stdout
    assert not marker.exists()
    lines = {ln for ln in out.stderr.splitlines() if ln.strip()}  # library() and the probe's build()
    assert len(lines) == 1, out.stderr
    line = lines.pop()
    assert "kernel cache" in line and "not used" in line and "owned by uid 65534" in line, line
    assert not list(private_tmp.glob("dslaunch-kernels-*"))  # the private build left nothing behind


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@BUILDS
def test_a_library_others_could_write_is_rebuilt_not_loaded(tmp_path: Path, fast_cc: Path) -> None:
    cache, marker = tmp_path / "cache", tmp_path / "ran"
    cache.mkdir(mode=0o700)
    lib = cache / _library_name(tmp_path)
    _plant(lib, marker)
    lib.chmod(0o666)
    out = _probe(tmp_path, CC=str(fast_cc))
    assert out.returncode == 0 and "IMPL dslaunch.kernels.cpu.torch_steps" in out.stdout, out.stderr
    assert not marker.exists()
    assert "rebuilding the CPU kernels" in _one_line(out.stderr) and "writable by others" in out.stderr
    assert lib.stat().st_mode & 0o777 == 0o700
    if os.geteuid() == 0:  # a file of another user in this user's directory: the same
        _plant(lib, marker)
        os.chown(lib, 65534, 65534)
        out = _probe(tmp_path, CC=str(fast_cc))
        assert "IMPL dslaunch.kernels.cpu.torch_steps" in out.stdout and not marker.exists(), out.stderr
        assert "owned by uid 65534" in _one_line(out.stderr)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_a_library_without_the_kernels_falls_back_in_one_line(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    lib = cache / _library_name(tmp_path)
    _plant(lib, tmp_path / "unused", source="int dsl_something_else;\n")
    lib.chmod(0o700)
    out = _probe(tmp_path)
    assert out.returncode == 0 and "IMPL dslaunch.kernels.reference -" in out.stdout, out.stderr
    line = _one_line(out.stderr)
    assert "using the torch reference" in line and "lacks a kernel" in line and "dsl_adam" in line, line
    assert "PARAM 0.8" in out.stdout
