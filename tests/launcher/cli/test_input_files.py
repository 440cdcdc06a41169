"""Every input file of every command is bounded before it is parsed: ``/dev/zero`` (never ends), a
FIFO (blocks its reader forever), a 1 GB file (sparse: no disk used) and a directory, given to
each command's file arguments, end in one line naming the file and a non-zero exit, promptly and
in bounded memory (the child's peak RSS, measured by a wrapper process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launcher.helpers import DSLAUNCH

# The command's arguments, with {} where the bad file goes.
COMMANDS = {
    "estimate --hf_config": ["estimate", "--hf_config", "{}"],
    "estimate --deepspeed_config": ["estimate", "--params", "1B", "--deepspeed_config", "{}"],
    "zero-to-fp32": ["zero-to-fp32", "{}", "{out}"],
    "status": ["status", "{}"],
    "launch --hostfile": ["--hostfile", "{}", "--dry-run", "{script}"],
    "launch --deepspeed_config": ["--num_gpus", "1", "--dry-run", "{script}", "--deepspeed_config", "{}"],
    "autotuning --deepspeed_config": ["--autotuning", "run", "--num_gpus", "1", "{script}", "--deepspeed_config", "{}"],
}
# The command's peak RSS is measured in a process of its own: RUSAGE_CHILDREN covers only it.
_MEASURED = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
             "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stdout); sys.exit(r.returncode)")
MAX_RSS_KB = 400 * 1024  # the interpreter and its imports (no torch needed to refuse a file)


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("inputs")
    fifo, big, folder = root / "fifo.json", root / "big.json", root / "folder"
    os.mkfifo(fifo)
    with open(big, "wb") as f:
        f.truncate(2**30)  # sparse
    folder.mkdir()
    return {"dev-zero": "/dev/zero", "fifo": str(fifo), "1GB": str(big), "directory": str(folder)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_bad_input_is_one_line_and_a_non_zero_exit(command, bad_inputs, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    for kind, path in bad_inputs.items():
        args = [a.format(path, out=tmp_path / "out.bin", script=script) for a in COMMANDS[command]]
        r = subprocess.run([sys.executable, "-c", _MEASURED, *DSLAUNCH, *args], capture_output=True, text=True,
                           timeout=120, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
        where = f"{command} with {kind}"
        assert r.returncode != 0, f"{where}: {r.stderr}"
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("dslaunch: error: "), f"{where}: {r.stderr!r}"
        assert path in r.stderr, f"{where}: {r.stderr}"
        assert "never run" not in r.stdout
        rss_kb = int(r.stdout.strip().splitlines()[-1])
        assert rss_kb < MAX_RSS_KB, f"{where}: peak RSS {rss_kb} KiB"
