"""The tensors an engine actually holds: its object graph walked, storages deduplicated by data_ptr.

What ``test_memory.py`` measures instead of trusting the strategy's own accounting: every tensor
reachable from the engine (module parameters and gradients, the strategy's shards, gradient
buffers, reduce buckets, in-flight gathers, the optimizer's state), each storage counted once.
"""

from __future__ import annotations

import os
import types
from collections import deque
from typing import Any

import torch

_SKIP = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType, types.FrameType, str, bytes, int, float, bool, type(None))


def held_storages(root: Any) -> dict[int, tuple[int, str]]:
    """data_ptr -> (bytes, device type) of every non-empty storage reachable from ``root``.

    Follows containers, objects' ``__dict__``/``__slots__`` and tensors' attributes and ``.grad``;
    not functions, classes or modules (that would reach the whole interpreter)."""
    out: dict[int, tuple[int, str]] = {}
    seen: set[int] = set()
    todo: deque[Any] = deque([root])
    while todo:
        o = todo.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            if storage.nbytes() and o.device.type != "meta":
                out[storage.data_ptr()] = (storage.nbytes(), o.device.type)
            if o.grad is not None:
                todo.append(o.grad)
            todo.extend(getattr(o, "__dict__", {}).values())
        elif isinstance(o, dict):
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, list | tuple | set | frozenset | deque):
            todo.extend(o)
        else:
            todo.extend(getattr(o, "__dict__", {}).values())
            for slot in getattr(type(o), "__slots__", ()):
                todo.append(getattr(o, slot, None))
    return out


def held_bytes(root: Any, device: str | None = None, outside: list[tuple[int, int]] | None = None) -> int:
    """Bytes of the storages reachable from ``root`` (on ``device`` type only, if given; not those
    starting inside one of the address ranges ``outside``, e.g. ``shared_segments()``)."""
    return sum(n for ptr, (n, dev) in held_storages(root).items()
               if (device is None or dev == device) and not any(lo <= ptr < hi for lo, hi in outside or ()))


def shared_segments(directory: str = "") -> list[tuple[str, int, int]]:
    """Where this process maps dslaunch's shared-memory segments (files named ``dslaunch-shm-*``,
    in ``directory`` if given; unlinked, so "(deleted)"): each one's path and address range."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            path = fields[5].rstrip("\n").removesuffix(" (deleted)") if len(fields) == 6 else ""
            where, name = os.path.split(path)
            if name.startswith("dslaunch-shm-") and (not directory or where == str(directory)):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                found.append((path, lo, hi))
    return found
