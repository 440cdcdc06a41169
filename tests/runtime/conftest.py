"""Fixtures for the runtime's tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    """``mount(size)``: a real tmpfs of ``size`` (``"64m"``) at a fresh directory, mounted again
    at another size on a second call; unmounted at the end. Skips where mounting is not allowed
    (root only): for shared-memory segments in a directory of a known size (``DSLAUNCH_SHM_DIR``)."""
    mounted = tmp_path / "shm"
    mounted.mkdir()

    def mount(size: str) -> Path:
        opts = f"size={size}" + (",remount" if os.path.ismount(mounted) else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mounted)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        return mounted

    yield mount
    if os.path.ismount(mounted):
        subprocess.run(["umount", "-l", str(mounted)], check=False)
