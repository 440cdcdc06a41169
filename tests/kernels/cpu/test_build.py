"""Building and loading the C kernels: the cache, concurrent builders, the fallback to torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslaunch.kernels.cpu import build

HAVE_CC = build.available()

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


def _probe(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, build.CACHE_ENV: str(tmp_path / "cache"), **env}
    return subprocess.run([sys.executable, "-c", _PROBE], env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(60)
def test_without_a_compiler_the_reference_runs_and_says_so_once(tmp_path: Path) -> None:
    out = _probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert out.returncode == 0, out.stderr
    assert "IMPL dslaunch.kernels.reference -" in out.stdout
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "CPU kernels unavailable, using the torch reference" in lines[0]
    assert "no-such-cc" in lines[0]
    assert "PARAM 0.8" in out.stdout  # two AdamW steps of 0.1 on a constant gradient


@pytest.mark.timeout(60)
def test_a_compiler_that_fails_falls_back(tmp_path: Path) -> None:
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fakecc 1.0; exit 0; }\necho 'error: no' >&2; exit 3\n")
    fake.chmod(0o755)
    out = _probe(tmp_path, CC=str(fake))
    assert out.returncode == 0 and "IMPL dslaunch.kernels.reference" in out.stdout
    assert "failed to build optim.c (exit 3): error: no" in out.stderr
    assert not list((tmp_path / "cache").glob("*.tmp"))  # the failed build left nothing


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.timeout(90)
def test_concurrent_builds_into_one_cache(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE], env={**os.environ, build.CACHE_ENV: str(tmp_path / "cache")},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=80) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    names = {ln.split()[-1] for out, _ in outs for ln in out.splitlines() if ln.startswith("IMPL")}
    assert all("IMPL dslaunch.kernels.cpu.torch_steps" in out for out, _ in outs)
    assert len(names) == 1 and "PARAM 0.8" in outs[0][0]
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert files == sorted(names)  # one library, no temporary files left


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_the_cache_key_follows_the_source_and_the_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {build.CACHE_ENV: str(tmp_path)}
    first = build.build(env)
    assert build.build(env) == first and first.parent == tmp_path
    wrapper = tmp_path / "cc"
    wrapper.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo other-version\nexec gcc \"$@\"\n")
    wrapper.chmod(0o755)
    assert build.build({**env, "CC": str(wrapper)}) != first
    src = tmp_path / "optim.c"
    src.write_text(build.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(build, "SOURCE", src)
    assert build.build(env) != first


def test_the_default_cache_dir() -> None:
    assert build.cache_dir({"HOME": "/h"}) == Path(os.path.expanduser("~")) / ".cache/dslaunch/kernels"
    assert build.cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/dslaunch/kernels")
    assert build.cache_dir({build.CACHE_ENV: "/k", "XDG_CACHE_HOME": "/x"}) == Path("/k")
