"""A forkserver for real DeepSpeed's interpreter: it imports torch and deepspeed once, then forks
one process per rank of each job the tests ask for (``tests/deepspeed_reference.py`` is its client).

Run in DeepSpeed's venv, stdlib and deepspeed only (dslaunch is not installed there). Each request
is one JSON line on stdin: ``{"argv": [script, *args], "envs": [env of each rank], "outs": [stdout
file of each rank], "errs": [stderr file of each rank], "cwd": folder, "timeout": seconds}``; the
answer is one JSON line on stdout, ``{"codes": [exit code of each rank]}`` (``null`` for a rank
killed at ``timeout``). A rank runs ``argv`` as ``python *argv`` would (``__main__``; the script's
folder first on ``sys.path``, or ``""`` for ``-c code``, the current folder for ``-m module``; only its ``env``; stdout and stderr into
its files; ``atexit`` handlers at the end). The server exits when stdin closes, so a pytest worker
that ends takes its server with it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import tempfile
import time
import traceback

# Imported before any fork: what every rank would otherwise import again (~2.5 s a process quiet)
import deepspeed  # noqa: F401
import torch  # noqa: F401


def _rank(argv: list[str], env: dict[str, str], out: str, err: str, cwd: str) -> None:
    """The child: run ``argv`` as a fresh interpreter would, then exit with its code (never returns)."""
    code = 0
    try:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        tempfile.tempdir = None  # cached in the server; a new interpreter reads TMPDIR
        with open(out, "wb") as f:
            os.dup2(f.fileno(), 1)
        if err == out:
            os.dup2(1, 2)
        else:
            with open(err, "wb") as f:
                os.dup2(f.fileno(), 2)
        with open(os.devnull, "rb") as f:
            os.dup2(f.fileno(), 0)
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""  # the server's own folder there: a new interpreter would not have it
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]  # run_module puts the module's file in argv[0], as python -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the script registered (process groups, loggers)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _job(request: dict) -> list[int | None]:
    """Fork every rank of ``request``; each one's exit code (``None``: killed at the timeout)."""
    pids = []
    for env, out, err in zip(request["envs"], request["outs"], request["errs"], strict=True):
        pid = os.fork()
        if pid == 0:
            _rank(request["argv"], env, out, err, request["cwd"])
        pids.append(pid)
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + request["timeout"]
    while len(codes) < len(pids):
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        if len(codes) < len(pids) and time.monotonic() > deadline:
            for pid in pids:
                if pid not in codes:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    codes[pid] = None
        time.sleep(0.02)
    return [codes[pid] for pid in pids]


def main() -> None:
    """Answer requests until stdin closes."""
    for line in sys.stdin:
        sys.stdout.write(json.dumps({"codes": _job(json.loads(line))}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
