"""What ``scripts/gpu/check.sh`` needs carried to a GPU machine without network
(``scripts/gpu/carry.txt``), and the wheels ``scripts/gpu/wheels.sh`` puts there: every folder the
check installs from is carried, the whole fits the device tool's 64 MiB, and the DeepSpeed folder
holds DeepSpeed 0.19.8 with every requirement it has on CPython 3.12 / Linux x86-64 (torch and
numpy excepted: the GPU image's own), each installable offline where this Python allows.
The wheel checks skip until ``scripts/gpu/wheels.sh`` has run (it needs PyPI)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
DEEPSPEED_WHEELS = ROOT / ".whl" / "deepspeed"
IMAGE_OWN = {"torch", "numpy"}  # the GPU image's builds; a wheel from here must not replace them
LIMIT = 64 * 2**20
# The GPU machine: CPython 3.12, Linux x86-64 (glibc new enough for manylinux_2_34).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(34, 4, -1)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                     "manylinux1_x86_64", "linux_x86_64"]
GPU_TAGS = set(cpython_tags((3, 12), platforms=PLATFORMS)) | set(compatible_tags((3, 12), "cp312", PLATFORMS))
GPU_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _carried() -> list[str]:
    lines = (GPU / "carry.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def _under_carried(path: str) -> bool:
    return any(path == c or path.startswith(c.rstrip("/") + "/") for c in _carried())


def test_the_carry_list_names_what_the_check_installs_from() -> None:
    carried = _carried()
    assert 0 < len(carried) <= 8 and all(len(c) <= 200 for c in carried), carried
    # carrying a tracked path is pointless (it travels anyway): each is one git ignores
    ignored = subprocess.run(["git", "check-ignore", *carried], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == sorted(carried)
    wheels = (GPU / "wheels.sh").read_text()
    written = set(re.findall(r'fetch "\$version" (\S+)', wheels)) | set(re.findall(r" -w (\S+)", wheels))
    assert {".whl", ".whl/deepspeed"} <= written, written
    assert all(_under_carried(path) for path in written), written
    check = (GPU / "check.sh").read_text()
    read = {m.rstrip("/") for m in re.findall(r"(?<![\w-])\.whl(?:/[\w.*-]+)*", check)}
    assert ".whl/deepspeed" in read and all(_under_carried(p.split("/*")[0]) for p in read), read


def test_the_working_tree_and_the_carried_paths_fit_in_64_mib() -> None:
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file())
    carried = sum(p.stat().st_size for c in _carried() if (ROOT / c).exists()
                  for p in [ROOT / c, *(ROOT / c).rglob("*")] if p.is_file())
    if not (DEEPSPEED_WHEELS.exists()):
        carried += 16 * 2**20  # what the wheels take when made (13 MiB on 2026-12-06), with room
    assert tree + carried < LIMIT, f"{tree / 2**20:.1f} MiB tree + {carried / 2**20:.1f} MiB carried"


def _metadata(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(name).decode())


@pytest.fixture(scope="module")
def wheels() -> dict[str, tuple[Path, object]]:
    if not list(DEEPSPEED_WHEELS.glob("deepspeed-*.whl")):
        pytest.skip("no .whl/deepspeed: run scripts/gpu/wheels.sh (needs PyPI)")
    out = {}
    for wheel in sorted(DEEPSPEED_WHEELS.glob("*.whl")):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        assert name not in out, f"two wheels of {name} in {DEEPSPEED_WHEELS}: pip would refuse the install"
        assert tags & GPU_TAGS, f"{wheel.name} does not install on CPython 3.12 / Linux x86-64"
        out[name] = (wheel, version)
    return out


def test_deepspeed_and_every_requirement_it_has_on_the_gpu_machine_are_there(wheels) -> None:
    wheel, version = wheels["deepspeed"]
    assert str(version) == "0.19.8"
    todo, seen = ["deepspeed"], set()
    while todo:
        name = todo.pop()
        seen.add(name)
        for line in _metadata(wheels[name][0]).get_all("Requires-Dist") or []:
            req = Requirement(line)
            if (req.marker and not req.marker.evaluate(GPU_ENV)) or canonicalize_name(req.name) in IMAGE_OWN:
                continue
            dep = canonicalize_name(req.name)
            assert dep in wheels, f"{name} needs {req}: no wheel of it in {DEEPSPEED_WHEELS}"
            assert req.specifier.contains(wheels[dep][1], prereleases=True), f"{name} needs {req}, have {wheels[dep][1]}"
            if dep not in seen:
                todo.append(dep)
    assert seen == set(wheels), f"wheels nothing requires: {set(wheels) - seen}"
    assert not IMAGE_OWN & set(wheels)


@pytest.mark.timeout(180)
def test_the_pure_python_wheels_install_offline_into_a_fresh_venv(wheels, tmp_path: Path) -> None:
    pure = [path for name, (path, _) in wheels.items() if path.name.endswith("-py3-none-any.whl")]
    assert len(pure) >= 5 and any(p.name.startswith("deepspeed-") for p in pure)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-index", "--no-deps", "--no-compile", "--find-links", str(DEEPSPEED_WHEELS),
                           *map(str, pure)], capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "list",
                             "--format", "freeze"], capture_output=True, text=True, timeout=60).stdout
    installed = {canonicalize_name(line.split("==")[0]) for line in listed.split()}
    assert {parse_wheel_filename(p.name)[0] for p in pure} <= installed
