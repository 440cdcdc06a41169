"""DeepSpeed's ``deepspeed.runtime.zero.muon.original_muon``: Muon's functions under their names there
(the implementation is ``dslaunch.runtime.optim.muon``)."""

from __future__ import annotations

import torch

from dslaunch.runtime.optim.muon import NS_METHODS, MuonWithAuxAdam, muon_update, newton_schulz

__all__ = ["NS_METHODS", "MuonWithAuxAdam", "muon_update", "zeropower_via_newtonschulz5",
           "zeropower_via_gram_newtonschulz"]


def zeropower_via_newtonschulz5(G: torch.Tensor, steps: int) -> torch.Tensor:  # noqa: N803 - DeepSpeed's name
    """Newton-Schulz orthogonalization, the standard quintic iteration."""
    return newton_schulz(G, steps, "standard")


def zeropower_via_gram_newtonschulz(G: torch.Tensor, steps: int) -> torch.Tensor:  # noqa: N803 - DeepSpeed's name
    """Newton-Schulz orthogonalization iterating on the Gram matrix (same result, fewer FLOPs)."""
    return newton_schulz(G, steps, "gram")
