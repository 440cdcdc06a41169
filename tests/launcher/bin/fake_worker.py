#!/usr/bin/env python3
"""A fake worker for launcher tests: behaves as told by its arguments, never imports torch.

Actions run in order, e.g. ``fake_worker.py print=hello sleep=0.2 exit=3``:

- ``print=TEXT`` / ``eprint=TEXT``: a line on stdout / stderr (``{rank}`` is replaced by RANK);
- ``env``: print the launcher's env contract as one JSON line on stdout;
- ``argv``: print sys.argv[1:] as JSON on stdout;
- ``ids``: print pid, process group, session and scheduler autogroup as one JSON line on stdout;
- ``sleep=S``; ``hang`` (sleep forever); ``ignore_term`` (SIGTERM is ignored from now on);
- ``grandchild=PIDFILE``: spawn a sleeping grandchild and write its pid to PIDFILE;
- ``daemon=PIDFILE``: the same, but in a new session (it leaves the worker's process group);
- ``exit=N``; ``signal=NAME`` (kill itself with that signal);
- ``raise=TEXT``: raise RuntimeError(TEXT) (an uncaught exception: traceback, exit 1); ``{addr}``
  in TEXT becomes an address that differs in every process (as in ``<object at 0x7f...>``);
- ``atexit_signal=NAME``: at interpreter exit, kill itself with that signal (an abort in teardown);
- ``var=NAME``: print ``NAME=<its value>`` on stdout;
- ``rR:ACTION``: run ACTION only on rank R, e.g. ``r1:exit=3`` (other ranks skip it);
- ``cK:ACTION``: run ACTION only in the job's K-th restart (``DSLAUNCH_RESTART_COUNT``; 0 = first
  run), e.g. ``c0:r1:signal=SIGKILL`` (prefixes combine).
"""

import atexit
import json
import os
import signal
import subprocess
import sys
import time

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "CROSS_RANK",
            "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")


def main(args: list[str]) -> int:
    rank = os.environ.get("RANK", "?")
    current = {"r": rank, "c": os.environ.get("DSLAUNCH_RESTART_COUNT", "0")}
    for arg in args:
        arg = _only_here(arg, current)
        if arg is None:
            continue
        key, _, value = arg.partition("=")
        if key.startswith("--local_rank"):
            continue
        if key == "print":
            print(value.replace("{rank}", rank), flush=True)
        elif key == "eprint":
            print(value.replace("{rank}", rank), file=sys.stderr, flush=True)
        elif key == "env":
            print(json.dumps({k: os.environ.get(k) for k in ENV_KEYS}), flush=True)
        elif key == "argv":
            print(json.dumps(sys.argv[1:]), flush=True)
        elif key == "ids":
            print(json.dumps({"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                              "autogroup": _autogroup()}), flush=True)
        elif key == "affinity":
            print(json.dumps(sorted(os.sched_getaffinity(0))), flush=True)
        elif key == "var":
            print(f"{value}={os.environ.get(value)}", flush=True)
        elif key == "sleep":
            time.sleep(float(value))
        elif key == "hang":
            while True:
                time.sleep(60)
        elif key == "ignore_term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        elif key in ("grandchild", "daemon"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                     start_new_session=key == "daemon")
            with open(value.replace("{rank}", rank), "w") as f:
                f.write(str(child.pid))
        elif key == "exit":
            return int(value)
        elif key == "raise":
            raise RuntimeError(value.replace("{addr}", f"0x7f{os.getpid():010x}"))
        elif key == "atexit_signal":
            atexit.register(os.kill, os.getpid(), getattr(signal, value))
        elif key == "signal":
            os.kill(os.getpid(), getattr(signal, value))
            time.sleep(5)
    return 0


def _only_here(arg: str, current: dict[str, str]) -> str | None:
    """``arg`` without its ``rR:``/``cK:`` prefixes, or None when one of them does not match."""
    while arg[:1] in current and ":" in arg and arg[1:arg.index(":")].isdigit():
        kind = arg[0]
        want, arg = arg[1:].split(":", 1)
        if want != current[kind]:
            return None
    return arg


def _autogroup() -> str | None:
    """'/autogroup-N' of this process (None on kernels without scheduler autogroups)."""
    try:
        with open("/proc/self/autogroup") as f:
            return f.read().split()[0]
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
