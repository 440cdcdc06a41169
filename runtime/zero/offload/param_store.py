"""ZeRO-Infinity's parameter side: one param group's shard of this rank kept on NVMe between uses.

``offload_param`` with ``device: nvme`` (stage 3): the shard (model dtype) lives in a ``SwapFile``;
only the first ``max_in_cpu`` elements of this rank's shards (over its param groups, in order, as
DeepSpeed counts them) stay in host memory. A gather reads just the range it needs; the step
writes the updated range back. The fp32 master the optimizer updates is not here: it is the
optimizer's (host memory, as with ``offload_param: cpu``).

Reads into a host tensor of the shard's dtype go straight from the file into it. Anything else (a
CUDA destination, another dtype) passes through a pool of at most ``buffer_count`` buffers of
``buffer_size`` elements (page-locked with ``pin_memory`` on GPU hosts), up to ``buffer_count``
requests in flight, so the host memory a transfer takes is bounded whatever the shard's size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dslaunch.runtime.zero.offload.swap import Pending, SwapFile, SwapSettings, buffer_slots

__all__ = ["ShardStore"]


class ShardStore:
    """``numel`` elements of ``dtype`` addressed by local offset: ``[0, in_cpu)`` in host memory,
    the rest in a nameless swap file under ``settings.path``.

    Raises:
        ConfigError: ``nvme_path`` missing or not writable, or too little free space (one line,
            naming ``zero_optimization.offload_param.nvme_path``); staging buffers that would not
            fit in host memory (naming ``buffer_count``).
    """

    def __init__(self, settings: SwapSettings, numel: int, dtype: torch.dtype, in_cpu: int, pin: bool):
        self.numel, self.dtype, self.pin = numel, dtype, pin
        self.esize = torch.empty((), dtype=dtype).element_size()
        in_cpu = max(0, min(in_cpu, numel))
        self.head = torch.empty(in_cpu, dtype=dtype)
        if pin:
            self.head = self.head.pin_memory()
        self.buffer_numel = max(1, min(settings.buffer_size, numel))
        on_disk = numel - in_cpu
        self._count = buffer_slots(settings, settings.buffer_count, -(-on_disk // self.buffer_numel),
                                   self.buffer_numel * self.esize)
        self._pool: list[torch.Tensor] = []  # at most _count, created on first use
        self.file = SwapFile(settings, on_disk * self.esize)

    @property
    def in_cpu(self) -> int:
        return self.head.numel()

    def held_bytes(self) -> int:
        """Host bytes held: the in-memory head and the staging buffers created so far."""
        return (self.head.numel() + sum(b.numel() for b in self._pool)) * self.esize

    # ----- reads ----------------------------------------------------------------------------
    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy elements ``[lo, hi)`` into ``out`` (1-D, ``hi - lo`` elements, any device/dtype)."""
        start = lo
        head = min(hi, self.in_cpu)
        if head > lo:
            out[:head - lo].copy_(self.head[lo:head])
        lo = max(lo, self.in_cpu)
        if hi <= lo:
            return
        tail = out[lo - start:]
        if _direct(tail, self.dtype):
            self.file.read((lo - self.in_cpu) * self.esize, tail).wait()
            return
        for (a, b), buf, pending in self._pipelined_reads(lo, hi):
            pending.wait()
            tail[a - lo:b - lo].copy_(buf[:b - a])

    def read_all(self) -> torch.Tensor:
        """The whole shard as a new host tensor (checkpoints, ``model_shard``)."""
        out = torch.empty(self.numel, dtype=self.dtype)
        self.read(0, self.numel, out)
        return out

    def _pipelined_reads(self, lo: int, hi: int) -> Iterator[tuple[tuple[int, int], torch.Tensor, Pending]]:
        """Chunks of ``[lo, hi)`` (file part) read through the pool, up to ``buffer_count`` ahead."""
        chunks = _chunks(lo, hi, self.buffer_numel)
        queue: list[tuple[tuple[int, int], torch.Tensor, Pending]] = []
        for i, (a, b) in enumerate(chunks):
            buf = self._buffer(i % self._count)
            queue.append(((a, b), buf, self.file.read((a - self.in_cpu) * self.esize, buf[:b - a])))
            if len(queue) == self._count:
                yield queue.pop(0)
        yield from queue

    # ----- writes ---------------------------------------------------------------------------
    def write(self, lo: int, src: torch.Tensor) -> None:
        """Store ``src`` (1-D, any device/dtype) as elements ``[lo, lo + src.numel())``."""
        hi = lo + src.numel()
        head = min(hi, self.in_cpu)
        if head > lo:
            self.head[lo:head].copy_(src[:head - lo])
        start = max(lo, self.in_cpu)
        if hi <= start:
            return
        tail = src[start - lo:]
        if _direct(tail, self.dtype):
            self.file.write((start - self.in_cpu) * self.esize, tail).wait()
            return
        pending: list[Pending | None] = [None] * self._count
        for i, (a, b) in enumerate(_chunks(start, hi, self.buffer_numel)):
            k = i % self._count
            if pending[k] is not None:  # the buffer's last write must be done before refilling it
                pending[k].wait()
            buf = self._buffer(k)[:b - a]
            buf.copy_(tail[a - start:b - start])
            pending[k] = self.file.write((a - self.in_cpu) * self.esize, buf)
        for p in pending:
            if p is not None:
                p.wait()

    def _buffer(self, k: int) -> torch.Tensor:
        while len(self._pool) <= k:
            buf = torch.empty(self.buffer_numel, dtype=self.dtype)
            self._pool.append(buf.pin_memory() if self.pin else buf)
        return self._pool[k]

    def close(self) -> None:
        """Free the file now (the kernel frees it at exit anyway)."""
        self.file.close()


def _direct(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the file can be read into / written from ``t`` as it is."""
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


def _chunks(lo: int, hi: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]
