"""A hostile local user for the tests of files dslaunch writes: a second account, files and links
owned by it, and a root-only victim file whose contents and mtime must not change.

The planting tests need root (to create another user's files); ``as_root`` skips them otherwise.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

import pytest

OTHER = "dslaunch-test-other"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="plants another user's files: needs root "
                                                      "(run the suite as root to include these tests)")


def other_uid() -> int:
    """The uid of a second user, created (no home, no login) when missing."""
    try:
        return pwd.getpwnam(OTHER).pw_uid
    except KeyError:
        pass
    made = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
                          capture_output=True, text=True, timeout=30)
    if made.returncode not in (0, 9):  # 9: made meanwhile by another test process
        pytest.fail(f"useradd {OTHER}: {made.stderr.strip()}")
    return pwd.getpwnam(OTHER).pw_uid


def give(path: Path | str, uid: int) -> None:
    """``path`` (a link itself, not its target) now belongs to ``uid``."""
    os.lchown(path, uid, uid)


class Victim:
    """A root-only file (0600) that a planted link points at."""

    def __init__(self, folder: Path):
        self.path = folder / "root-only"
        self.path.write_text("root's secret\n")
        os.chmod(self.path, 0o600)
        os.utime(self.path, (1_000_000_000, 1_000_000_000))

    def plant(self, link: Path | str, uid: int | None = None) -> None:
        """A symbolic link at ``link`` to the victim (owned by ``uid`` when given)."""
        os.symlink(self.path, link)
        if uid is not None:
            give(link, uid)

    def untouched(self) -> bool:
        st = os.stat(self.path)
        return self.path.read_text() == "root's secret\n" and st.st_mtime == 1_000_000_000 and st.st_size == 14
