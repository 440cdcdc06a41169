"""paramiko for the launcher: imported without ``invoke``, which loads only when a config needs it.

paramiko 3 imports ``invoke`` at start-up for one feature, ssh config ``Match exec`` lines, and
``invoke`` brings asyncio and unittest.mock with it: ~60 ms of the ~150 ms it takes to import
paramiko, paid on every launch before the first connection. Here paramiko is imported with
``invoke`` blocked (paramiko then keeps ``invoke = None`` and raises only when a ``Match exec``
is evaluated); ``lookup`` imports ``invoke`` for real the first time a config has such a line.

Every launcher module imports paramiko from here, so whichever comes first blocks ``invoke``.
"""

from __future__ import annotations

import sys

if "paramiko" not in sys.modules and "invoke" not in sys.modules:
    sys.modules["invoke"] = None  # type: ignore[assignment]  # makes `import invoke` fail fast
    try:
        import paramiko
    finally:
        del sys.modules["invoke"]
else:
    import paramiko

__all__ = ["paramiko", "lookup"]


def lookup(config: paramiko.SSHConfig, alias: str) -> paramiko.SSHConfigDict:
    """``config.lookup(alias)``, loading ``invoke`` first if a ``Match exec`` line needs it."""
    try:
        return config.lookup(alias)
    except ImportError:
        import invoke
        import paramiko.config

        paramiko.config.invoke = invoke
        return config.lookup(alias)
