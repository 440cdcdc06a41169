"""The environment report: ``dslaunch report``, ``ds_report`` and DeepSpeed's ``deepspeed.env_report``.

What a bug report needs, probed without side effects (nothing is built, no process group made):
versions (Python, torch and its CUDA/ROCm, NCCL, gloo, MPI, triton, transformers, accelerate,
dslaunch, the ``deepspeed`` distribution), devices and their memory, NVML, compilers, the kernels
(CPU C kernels built or buildable, Triton runnable), the kernel cache, the network interfaces gloo
and NCCL would pick, SSH/SLURM availability and install locations.

``collect()`` returns ``Section``s of ``Item``s; ``as_text`` prints them as DeepSpeed's dotted
lines, ``as_json`` as ``{section: {key: value}}`` plus the warnings. Every probe catches its own
failure and reports it as the item's value: a missing component is a line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Item", "Section", "collect", "as_text", "as_json", "main", "cli_main"]

Status = Literal["ok", "warn", "fail", "info"]


@dataclass(frozen=True)
class Item:
    """One reported fact: ``key`` for tools, ``label`` for people, ``value`` (JSON-able), a status,
    a note, and ``text``: how people read the value where it differs (bytes as GiB)."""

    key: str
    label: str
    value: Any
    status: Status = "info"
    note: str = ""
    text: str | None = None


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    items: tuple[Item, ...] = field(default_factory=tuple)


def _probe(key: str, label: str, fn: Callable[[], Item | tuple[Any, Status, str]]) -> Item:
    """Run one probe; its exception becomes the item's value."""
    try:
        got = fn()
    except Exception as err:  # a probe never stops the report
        return Item(key, label, None, "fail", f"{type(err).__name__}: {str(err)[:200]}")
    if isinstance(got, Item):
        return got
    value, status, note = got
    return Item(key, label, value, status, note)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_version(name: str) -> tuple[Any, Status, str]:
    """The installed version of a module's distribution, found without importing it (importing
    triton or transformers takes seconds); why it is missing otherwise."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError) as err:
        return None, "fail", f"broken install: {type(err).__name__}: {str(err)[:160]}"
    if spec is None:
        return None, "warn", "not installed"
    return _version(name) or "unknown version", "ok", spec.origin or ""


def _run(cmd: list[str], timeout: float = 10) -> str | None:
    """A command's output; None when it is missing or fails."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout or out.stderr).strip() if out.returncode == 0 else None


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _sized(key: str, label: str, n: int, status: Status = "info", note: str = "") -> Item:
    return Item(key, label, n, status, note, text=_gib(n))


# ----- sections ---------------------------------------------------------------------------------

def _versions() -> Section:
    import torch
    import torch.distributed as dist

    def nccl() -> tuple[Any, Status, str]:
        if not torch.cuda.is_available() and torch.version.cuda is None:
            return None, "info", "CPU build of torch (no NCCL)"
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v), "ok", ""

    def deepspeed() -> tuple[Any, Status, str]:
        v = _version("deepspeed")
        if v is None:
            return None, "info", "no `deepspeed` distribution (pip install -e compat/deepspeed for dslaunch's)"
        return v, "ok", "dslaunch's compatibility distribution" if "+dslaunch" in v else "a real DeepSpeed"

    items = [
        Item("python", "python", sys.version.split()[0], "ok"),
        Item("torch", "torch", torch.__version__, "ok"),
        _probe("torch_cuda", "torch cuda version", lambda: (torch.version.cuda, "info", "" if torch.version.cuda
                                                            else "no CUDA in this torch build")),
        _probe("torch_hip", "torch hip version", lambda: (getattr(torch.version, "hip", None), "info", "")),
        _probe("nccl", "nccl", nccl),
        _probe("gloo", "gloo", lambda: (dist.is_available() and dist.is_gloo_available(), "ok", "")),
        _probe("mpi", "mpi backend", lambda: (dist.is_available() and dist.is_mpi_available(), "info", "")),
    ]
    for name in ("triton", "transformers", "accelerate"):
        items.append(_probe(name, name, lambda n=name: _module_version(n)))
    import dslaunch

    items.append(Item("dslaunch", "dslaunch", dslaunch.__version__, "ok"))
    items.append(_probe("deepspeed", "deepspeed distribution", deepspeed))
    return Section("versions", "versions", tuple(items))


def _devices() -> Section:
    import psutil
    import torch

    def devices() -> tuple[Any, Status, str]:
        if not torch.cuda.is_available():
            return [], "info", "no CUDA device visible to torch (CPU workers use gloo)"
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append({"index": i, "name": p.name, "memory_bytes": p.total_memory})
        text = "; ".join(f"{d['index']}: {d['name']} {_gib(d['memory_bytes'])}" for d in out)
        return Item("devices", "devices", out, "ok", text=text)

    def shm() -> Item:
        st = os.statvfs("/dev/shm")
        size = st.f_frsize * st.f_blocks
        if size < 512 * 2**20:
            return _sized("shm", "shared memory /dev/shm", size, "warn",
                          "small: NCCL and data loaders need more (docker --shm-size)")
        return _sized("shm", "shared memory /dev/shm", size, "ok")

    from dslaunch.runtime.accelerator import get_accelerator

    return Section("devices", "devices", (
        _probe("accelerator", "accelerator", lambda: (get_accelerator().device_name(), "ok", "")),
        _probe("devices", "devices", devices),
        Item("cpu_count", "cpu cores", os.cpu_count(), "info"),
        _probe("host_memory", "host memory", lambda: _sized("host_memory", "host memory", psutil.virtual_memory().total)),
        _probe("shm", "shared memory /dev/shm", shm),
    ))


def _nvml() -> Section:
    def driver() -> tuple[Any, Status, str]:
        try:
            import pynvml
        except ImportError:
            return None, "warn", "pynvml not installed (pip install nvidia-ml-py): GPU memory in the monitor is off"
        try:
            pynvml.nvmlInit()
        except Exception as err:
            return None, "info", f"no NVIDIA driver ({type(err).__name__})"
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            count = pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
        version = version.decode() if isinstance(version, bytes) else version
        return {"driver": version, "devices": count}, "ok", ""

    return Section("nvml", "NVML", (_probe("nvml", "nvml", driver),))


def _compilers(environ: Mapping[str, str]) -> Section:
    def cc() -> tuple[Any, Status, str]:
        name = environ.get("CC") or "gcc"
        path = shutil.which(name, path=environ.get("PATH"))
        out = _run([path, "--version"]) if path else None
        if not out:
            return None, "warn", f"C compiler {name!r} not found (set CC): CPU kernels fall back to torch"
        return {"path": path, "version": out.splitlines()[0]}, "ok", ""

    def nvcc() -> tuple[Any, Status, str]:
        home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
        path = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc", path=environ.get("PATH"))
        out = _run([path, "--version"]) if path else None
        if not out or "release " not in out:
            return None, "info", "not found (not needed: Triton compiles the GPU kernels)"
        return out.split("release ", 1)[1].split(",")[0], "info", path

    return Section("compilers", "compilers", (_probe("cc", "C compiler", cc), _probe("nvcc", "nvcc", nvcc)))


def _kernels(environ: Mapping[str, str]) -> Section:
    from dslaunch.kernels import dispatch
    from dslaunch.kernels.cpu import build

    def cpu() -> tuple[Any, Status, str]:
        try:
            path = build.cached_path(environ)
        except build.KernelBuildError as err:
            return "unavailable", "warn", f"{err}; the torch reference runs"
        if path.is_file():
            return "built", "ok", str(path)
        return "buildable", "ok", "compiled on first use (~0.3 s)"

    def triton() -> tuple[Any, Status, str]:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "not installed", "info", "pip install 'dslaunch[triton]' for the GPU kernels"
        from dslaunch.kernels.triton import available

        if available():
            return "runnable", "ok", ""
        return "interpreter only", "info", "no CUDA device: Triton kernels run only under TRITON_INTERPRET=1"

    return Section("kernels", "kernels", (
        _probe("mode", "dispatch mode (DSLAUNCH_KERNELS)", lambda: (dispatch.mode(environ), "info", "")),
        _probe("cpu_kernels", "CPU C kernels", cpu),
        _probe("triton_kernels", "Triton kernels", triton),
        _probe("cache", "kernels cache", lambda: (str(build.cache_dir(environ)), "info", "")),
    ))


def _interfaces() -> dict[str, list[str]]:
    import psutil

    return {name: [a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
            for name, addrs in psutil.net_if_addrs().items()}


def _gloo_interface(environ: Mapping[str, str], interfaces: dict[str, list[str]]) -> tuple[Any, Status, str]:
    """gloo binds to ``GLOO_SOCKET_IFNAME``, else to the address this host's name resolves to."""
    if environ.get("GLOO_SOCKET_IFNAME"):
        name = environ["GLOO_SOCKET_IFNAME"]
        ok = name in interfaces
        return name, "ok" if ok else "fail", "from GLOO_SOCKET_IFNAME" + ("" if ok else ": no such interface")
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None, "fail", f"host name {host!r} does not resolve: set GLOO_SOCKET_IFNAME"
    owner = next((n for n, addrs in interfaces.items() if address in addrs), None)
    if address.startswith("127."):
        return owner or "lo", "warn", (f"{host!r} resolves to {address}: other hosts cannot reach it; set "
                                       "GLOO_SOCKET_IFNAME for multi-node jobs")
    return owner, "ok", f"{host!r} resolves to {address}"


def _nccl_interface(environ: Mapping[str, str], interfaces: dict[str, list[str]]) -> tuple[Any, Status, str]:
    """NCCL's socket interface: ``NCCL_SOCKET_IFNAME``, else an ib* interface, else the first that
    is neither loopback nor docker (NCCL's default order)."""
    if environ.get("NCCL_SOCKET_IFNAME"):
        return environ["NCCL_SOCKET_IFNAME"], "ok", "from NCCL_SOCKET_IFNAME"
    names = sorted(n for n, addrs in interfaces.items() if addrs)
    pick = next((n for n in names if n.startswith("ib")), None) or \
        next((n for n in names if not n.startswith(("lo", "docker"))), None)
    return pick, "info" if pick else "warn", "" if pick else "only loopback: NCCL works on this host only"


def _network(environ: Mapping[str, str]) -> Section:
    interfaces = _interfaces()
    return Section("network", "network", (
        Item("interfaces", "interfaces", interfaces),
        Item("hostname", "host name", socket.gethostname()),
        _probe("gloo_interface", "gloo would use", lambda: _gloo_interface(environ, interfaces)),
        _probe("nccl_interface", "NCCL would use", lambda: _nccl_interface(environ, interfaces)),
    ))


def _launchers(environ: Mapping[str, str]) -> Section:
    def tool(name: str, why: str) -> Callable[[], tuple[Any, Status, str]]:
        def probe() -> tuple[Any, Status, str]:
            path = shutil.which(name, path=environ.get("PATH"))
            return path, "ok" if path else "info", "" if path else f"not on PATH ({why})"
        return probe

    def paramiko() -> tuple[Any, Status, str]:
        version, status, note = _module_version("paramiko")
        return version, "ok" if version else "warn", note and f"{note}: the ssh launcher needs it"

    job = environ.get("SLURM_JOB_ID")
    return Section("launchers", "launchers", (
        _probe("ssh", "ssh", tool("ssh", "not needed: dslaunch connects with paramiko")),
        _probe("paramiko", "paramiko", paramiko),
        _probe("srun", "srun", tool("srun", "--launcher slurm needs it")),
        _probe("sbatch", "sbatch", tool("sbatch", "dslaunch sbatch needs it")),
        Item("slurm_job", "SLURM allocation", job, "info", "" if job else "not inside an allocation"),
    ))


def _install() -> Section:
    import torch

    import dslaunch

    return Section("install", "install", (
        Item("python_executable", "python", sys.executable),
        Item("dslaunch_path", "dslaunch install path", list(dslaunch.__path__)),
        Item("torch_path", "torch install path", list(torch.__path__)),
        Item("prefix", "environment", sys.prefix),
    ))


def collect(environ: Mapping[str, str] | None = None) -> list[Section]:
    """Every section, probed now (``environ`` defaults to ``os.environ``)."""
    env = os.environ if environ is None else environ
    return [_versions(), _devices(), _nvml(), _compilers(env), _kernels(env), _network(env), _launchers(env),
            _install()]


# ----- output ----------------------------------------------------------------------------------

_DOTS = 33  # DeepSpeed's column
_MARK = {"ok": "[OKAY]", "warn": "[WARNING]", "fail": "[FAIL]", "info": ""}
_COLOR = {"ok": "\033[92m", "warn": "\033[93m", "fail": "\033[91m"}


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_show(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list):
        return "; ".join(_show(v) for v in value) or "none"
    return str(value)


def as_text(sections: list[Section], color: bool = False, notes: bool = True) -> str:
    """DeepSpeed's layout: ``name ...... value [STATUS] note``, one titled block per section."""
    rule = "-" * 60
    lines = [rule, "dslaunch environment report", rule]
    for sec in sections:
        lines.append(f"{sec.title}:")
        for it in sec.items:
            mark = _MARK[it.status]
            if mark and color:
                mark = f"{_COLOR[it.status]}{mark}\033[0m"
            value = it.text if it.text is not None else _show(it.value)
            text = " ".join(x for x in (value, mark, it.note if notes else "") if x)
            lines.append(f"{it.label} {'.' * max(_DOTS - len(it.label), 3)} {text}")
        lines.append(rule)
    return "\n".join(lines)


def as_json(sections: list[Section]) -> dict:
    """``{section: {key: value}}``, ``"notes"`` (section.key -> note) and ``"warnings"`` (warn/fail)."""
    out: dict[str, Any] = {s.key: {i.key: i.value for i in s.items} for s in sections}
    out["notes"] = {f"{s.key}.{i.key}": i.note for s in sections for i in s.items if i.note}
    out["warnings"] = [f"{s.key}.{i.key}: {i.note or i.status}" for s in sections for i in s.items
                       if i.status in ("warn", "fail")]
    return out


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False, as_json_output: bool = False,
         ) -> None:
    """Print the report (DeepSpeed's ``deepspeed.env_report.main`` arguments: the first drops the
    kernels section, the second the notes and warnings)."""
    sections = [s for s in collect() if not (hide_operator_status and s.key == "kernels")]
    if as_json_output:
        print(json.dumps(as_json(sections), indent=1, default=str))
        return
    if hide_errors_and_warnings:
        sections = [Section(s.key, s.title, tuple(i for i in s.items if i.status not in ("warn", "fail")))
                    for s in sections]
    print(as_text(sections, color=sys.stdout.isatty(), notes=not hide_errors_and_warnings))


def cli_main(argv: list[str] | None = None) -> int:
    """``ds_report`` (DeepSpeed's flags, plus ``--json``)."""
    parser = argparse.ArgumentParser(prog="ds_report", description="dslaunch's environment report")
    parser.add_argument("--hide_operator_status", action="store_true", help="Leave out the kernels section.")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="Leave out notes and warnings.")
    parser.add_argument("--json", action="store_true", help="JSON for tools.")
    args = parser.parse_args(argv)
    main(args.hide_operator_status, args.hide_errors_and_warnings, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
