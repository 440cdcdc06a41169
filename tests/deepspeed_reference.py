"""Real DeepSpeed's reference jobs, each rank forked from an interpreter that imported torch and
deepspeed once (``tests/deepspeed_forkserver.py``), as ``tests/distributed.py`` does for dslaunch.

A job's ranks used to be fresh interpreters, each paying torch's and deepspeed's imports (~2.5 s
of CPU a process quiet, several times that under load) before any reference number came out.
``run_ranks`` keeps what a fresh interpreter gives a rank: ``__main__``, the script's folder on
``sys.path``, only the environment it is given, its own stdout and stderr. One server per pytest
worker and interpreter, started on first use; it exits with the worker (its stdin closes).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import threading
from pathlib import Path

SERVER = Path(__file__).with_name("deepspeed_forkserver.py")


class _Server:
    """One forkserver process and the lock that keeps its requests one at a time."""

    def __init__(self, python: Path, pythonpath: str) -> None:
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
        self.proc = subprocess.Popen([str(python), str(SERVER)], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lock = threading.Lock()

    def job(self, request: dict) -> list[int | None]:
        with self.lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"DeepSpeed's forkserver ({SERVER.name}) exited with {self.proc.wait()}")
        return json.loads(answer)["codes"]


@functools.cache
def _server(python: Path, pythonpath: str) -> _Server:
    return _Server(python, pythonpath)


def run_ranks(python: Path, argv: list[str], envs: list[dict[str, str]], logs: list[Path],
              timeout: float, errs: list[Path] | None = None, cwd: Path | None = None) -> list[int | None]:
    """Run ``python argv...`` once per entry of ``envs`` (one rank each, all at once) in ``cwd``
    (the current folder by default), stdout and stderr of each into its ``logs`` entry.

    Args:
        python: DeepSpeed's interpreter (the ``deepspeed_python`` fixture).
        argv: the script and its arguments, or ``-c``/``-m``, the code/module and its arguments.
        envs: each rank's whole environment; every one has the same ``PYTHONPATH`` (read when the
            server starts: the server is per interpreter and ``PYTHONPATH``).
        logs: each rank's output file.
        timeout: seconds for the whole job; ranks still running then are killed.
        errs: each rank's stderr file, if not its ``logs`` entry.
        cwd: the folder the ranks run in.

    Returns:
        Each rank's exit code, ``None`` for one killed at ``timeout``.
    """
    paths = {env.get("PYTHONPATH", "") for env in envs}
    assert len(paths) == 1, f"one PYTHONPATH for all ranks, not {paths}"
    request = {"argv": [str(a) for a in argv], "envs": envs, "outs": [str(p) for p in logs],
               "errs": [str(p) for p in (errs or logs)], "cwd": str(cwd or os.getcwd()), "timeout": timeout}
    return _server(Path(python), paths.pop()).job(request)


def run_python(python: Path, argv: list[str], env: dict[str, str], timeout: float,
               check: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *argv], env=env, capture_output=True, text=True, timeout=timeout)``
    with DeepSpeed's interpreter, the process forked from the server.

    Args:
        python: DeepSpeed's interpreter (the ``deepspeed_python`` fixture).
        argv: the script and its arguments, or ``-c``/``-m``, the code/module and its arguments.
        env: the process's whole environment.
        timeout: seconds; the process is killed then.
        check: raise if it exits with another code than 0.
        cwd: the folder it runs in (the current one by default).

    Returns:
        Its exit code, stdout and stderr (text).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout``.
        subprocess.CalledProcessError: ``check`` and it failed.
    """
    with tempfile.TemporaryDirectory(prefix="dslaunch-deepspeed-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        (code,) = run_ranks(python, argv, [env], [out], timeout, errs=[err], cwd=cwd)
        stdout, stderr = (p.read_text(errors="replace") if p.exists() else "" for p in (out, err))
    cmd = [str(python), *map(str, argv)]
    if code is None:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    if check and code:
        raise subprocess.CalledProcessError(code, cmd, stdout, stderr)
    return subprocess.CompletedProcess(cmd, code, stdout, stderr)
