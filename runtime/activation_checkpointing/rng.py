"""Random-number state for recomputation: DeepSpeed's (Megatron's) named RNG tracker and a snapshot.

``CudaRNGStatesTracker`` keeps named generator states (``add``, ``fork``, ``get_states``,
``set_states``, ``reset``): model-parallel code draws dropout for tensor-sliced activations from a
per-slice stream (``fork()``) and replicated ones from the default stream. The names are
DeepSpeed's; the generator is the accelerator's: the CUDA one on CUDA, the CPU one on a machine
without GPUs.

``RngSnapshot`` captures everything a checkpointed function may draw from (the CPU generator, the
device generator, every tracker state) before its forward and replays it for the recompute, so
dropout masks are the same bits both times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dslaunch.runtime.accelerator import get_accelerator

__all__ = ["CudaRNGStatesTracker", "RngSnapshot", "MODEL_PARALLEL_RNG", "model_parallel_seeds"]

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's / Megatron's tracker name
_TP_SEED_OFFSET = 2718  # DeepSpeed's offset between the data-parallel and the tensor-parallel seeds


class CudaRNGStatesTracker:
    """Named generator states, switched in with ``fork(name)``; DeepSpeed's class and errors."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are immutable byte tensors)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the states (e.g. from ``get_states`` or a checkpoint)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Add a state named ``name`` seeded with ``seed``; the current generator is untouched.

        Raises:
            Exception: the seed or the name was added before (DeepSpeed raises the same).
        """
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.seeds_.add(seed)
        acc = get_accelerator()
        orig = acc.get_rng_state()
        acc.manual_seed(seed)
        self.states_[name] = acc.get_rng_state()
        acc.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the state ``name`` inside the block; it advances, the default one does not.

        Raises:
            Exception: ``name`` was never added.
        """
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        acc = get_accelerator()
        orig = acc.get_rng_state()
        acc.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state()
            acc.set_rng_state(orig)


def model_parallel_seeds(seed: int, tp_rank: int) -> tuple[int, int]:
    """``(data-parallel seed, tensor-parallel seed)`` as DeepSpeed derives them from ``seed``."""
    return seed, seed + _TP_SEED_OFFSET + tp_rank


@dataclass(frozen=True)
class RngSnapshot:
    """The generator states a function may draw from, captured before its forward."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, tracker: CudaRNGStatesTracker) -> RngSnapshot:
        return cls(torch.get_rng_state(), _device_state(), tracker.get_states())

    def restore(self, tracker: CudaRNGStatesTracker) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            torch.cuda.set_rng_state(self.device)
        tracker.set_states(self.tracker)

    @contextlib.contextmanager
    def replayed(self, tracker: CudaRNGStatesTracker) -> Iterator[None]:
        """Run the block with these states, then put back the ones it found (backward's own)."""
        now = RngSnapshot.capture(tracker)
        self.restore(tracker)
        try:
            yield
        finally:
            now.restore(tracker)


def _device_state() -> torch.Tensor | None:
    # Only initialised CUDA: asking for the state would initialise it (and on CPU there is none).
    return torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
