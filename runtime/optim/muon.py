"""Muon (ds_config ``"type": "Muon"``): orthogonalized momentum for hidden matrices, AdamW for the rest.

Semantics follow DeepSpeed's ``MuonWithAuxAdam`` (Keller Jordan's Muon, DeepSpeed 0.17.6+):

- Which parameters: a parameter with ``ndim >= 2`` whose name contains neither ``embed`` nor
  ``lm_head`` gets Muon, every other one (embeddings, the output head, biases, norms) AdamW
  (``is_muon_param``). A ``use_muon`` attribute set on a parameter before ``initialize()`` wins
  (DeepSpeed overwrites it; keeping the user's choice is deliberate).
- Muon, per matrix ``W`` with gradient ``g`` and momentum ``m``::

      m = lerp(m, g, 1 - momentum)
      u = lerp(g, m, momentum) if nesterov else m            (Nesterov, DeepSpeed's default)
      O = newton_schulz(u, ns_steps, ns_method) * sqrt(max(1, rows / cols))
      W = W * (1 - lr * weight_decay) - lr * O

  A 4-D (convolution) weight is viewed as ``(out, in * kh * kw)``; a 3-D weight is a batch of
  matrices (per-expert weights). ``rows / cols`` are the parameter's last two dimensions, as
  DeepSpeed's.
- AdamW (DeepSpeed's defaults betas (0.9, 0.95), eps 1e-10), bias-corrected, decoupled decay.

Under ZeRO each rank holds one flat shard per param group, so a matrix may be cut between ranks.
Momentum and the Nesterov mix are element-wise, so they stay sharded like the master (the
checkpoint format of every other optimizer); only the orthogonalization needs whole matrices:
each step all-gathers the group's ``u`` over the data-parallel group (one all-gather per Muon
group, the size of a parameter publish) and every rank orthogonalizes the matrices its shard
touches. So ``step()`` is a collective when ``gather`` is given. DeepSpeed instead applies
momentum and Newton-Schulz in ZeRO-1/2's gradient partitioning, i.e. before unscaling and
clipping, and its stage-0 step is a plain SGD step on the matrices; here every stage runs the
update above on the unscaled, clipped gradient.

Newton-Schulz runs in fp32 on the CPU (fp64 for fp64 input), and as DeepSpeed on a GPU: bf16 for
``"standard"``, fp16 for ``"gram"``.

Limitations: ``offload_optimizer`` is refused (the offloaded step feeds the optimizer buckets,
not whole groups).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from dslaunch.runtime.optim.chunks import ChunkedOptimizer
from dslaunch.runtime.zero.partition import GroupLayout

__all__ = ["NS_METHODS", "MuonWithAuxAdam", "is_muon_param", "muon_update", "newton_schulz",
           "orthogonalized_update", "split_muon_groups"]

NS_METHODS = ("gram", "standard")

# Coefficients of the quintic iteration x <- a x + b (x x^T) x + c (x x^T)^2 x (Keller Jordan's):
# they push small singular values up fast rather than converging exactly to 1.
_A, _B, _C = 3.4445, -4.7750, 2.0315
_GRAM_RESTART = 2  # gram iteration: rebuild x and x x^T from scratch here (half-precision drift)

# A gather of one flat shard over the data-parallel group: returns the group's whole flat vector.
Gather = Callable[[torch.Tensor, GroupLayout], torch.Tensor]


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """Whether DeepSpeed's rule (or the parameter's own ``use_muon``) puts ``p`` under Muon."""
    flag = getattr(p, "use_muon", None)
    if flag is not None:
        return bool(flag)
    lowered = name.lower()
    return p.ndim >= 2 and "embed" not in lowered and "lm_head" not in lowered


def _ns_dtype(t: torch.Tensor, method: str) -> torch.dtype:
    if t.device.type == "cpu":
        return torch.float64 if t.dtype == torch.float64 else torch.float32
    if method == "gram":
        return torch.float16
    return torch.bfloat16 if t.device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float32


def newton_schulz(g: torch.Tensor, steps: int = 5, method: str = "gram") -> torch.Tensor:
    """Approximately orthogonalize ``g`` (a matrix or a batch of them): ``U V^T`` of its SVD, with
    singular values left roughly in [0.7, 1.2]. Returns the compute dtype (see the module doc).

    ``"standard"`` iterates on ``x`` (rows x cols, rows <= cols); ``"gram"`` iterates on the small
    ``x x^T`` and a polynomial ``q`` with ``x_k = q x_0``: the same result in fewer FLOPs on wide
    matrices (square ones take the standard path).
    """
    x = g.to(_ns_dtype(g, method))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    if method == "gram" and x.size(-1) > x.size(-2):
        x = _gram_iterations(x, steps)
    else:
        for _ in range(steps):
            s = x @ x.mT
            x = _A * x + (_B * s + _C * s @ s) @ x
    return x.mT if tall else x


def _gram_iterations(x: torch.Tensor, steps: int) -> torch.Tensor:
    # With p_k = a + b s_k + c s_k^2 (s_k = x_k x_k^T): x_{k+1} = p_k x_k, so x_k = q_k x_0 with
    # q_{k+1} = p_k q_k, and s_{k+1} = p_k s_k p_k = p_k (p_k s_k) (all polynomials in s_0 commute).
    s = x @ x.mT
    q = None
    for i in range(steps):
        if i == _GRAM_RESTART:
            x = q @ x
            s = x @ x.mT
            q = None
        z = _B * s + _C * s @ s  # p_k - a
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(_A)
        else:
            q = _A * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:  # s is not needed after the last step / a restart
            ps = _A * s + z @ s
            s = _A * ps + z @ ps
    return q @ x


def orthogonalized_update(u: torch.Tensor, steps: int = 5, method: str = "gram") -> torch.Tensor:
    """Muon's update for one parameter-shaped ``u`` (momentum, Nesterov-mixed): Newton-Schulz of
    its matrix view, scaled by ``sqrt(max(1, rows / cols))``, in ``u``'s shape and dtype."""
    if u.ndim < 2:
        raise ValueError(f"Muon needs a parameter with at least 2 dimensions, got shape {tuple(u.shape)}")
    matrix = u.reshape(u.shape[0], -1) if u.ndim >= 4 else u
    out = newton_schulz(matrix, steps, method) * max(1.0, u.size(-2) / u.size(-1)) ** 0.5
    return out.to(u.dtype).reshape(u.shape)


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float = 0.95, ns_steps: int = 5,
                nesterov: bool = True, ns_method: str = "gram", is_expert_group: bool = False) -> torch.Tensor:
    """DeepSpeed's per-parameter Muon function: advances ``momentum`` in place and returns the
    orthogonalized update (``grad``'s shape; ``grad`` is left as it was). A 3-D tensor is a batch
    of matrices whether or not ``is_expert_group`` is set."""
    return orthogonalized_update(_mixed(grad, momentum, beta, nesterov), ns_steps, ns_method)


def _mixed(g: torch.Tensor, m: torch.Tensor, beta: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum ``m`` in place; return what is orthogonalized (Nesterov: a new tensor)."""
    m.lerp_(g, 1 - beta)
    return g.lerp(m, beta) if nesterov else m


def split_muon_groups(groups: Sequence[Any], make: Callable[[Any, list[int], bool], Any]) -> list[Any]:
    """Split each param group into its Muon part and its AdamW part (``use_muon`` True/False),
    and set ``use_muon`` on each parameter (DeepSpeed's ``initialize`` does).

    Args:
        groups: the engine's groups; each has ``params`` and ``names``.
        make: ``make(group, indices, use_muon)`` builds the sub-group of ``group`` holding the params
            at ``indices`` (order kept), with ``use_muon`` among its hyperparameters.

    Returns:
        The non-empty sub-groups, Muon part first for each input group.
    """
    out = []
    for group in groups:
        flags = [is_muon_param(n, p) for n, p in zip(group.names, group.params, strict=True)]
        for flag, name, p in zip(flags, group.names, group.params, strict=True):
            if flag and p.ndim < 2:
                raise ValueError(f"parameter {name!r} (shape {tuple(p.shape)}) has use_muon=True, but "
                                 "Muon needs a matrix (2 or more dimensions): set use_muon=False on it")
            p.use_muon = flag  # as DeepSpeed's initialize leaves it: scripts read it
        for wanted in (True, False):
            indices = [i for i, f in enumerate(flags) if f == wanted]
            if indices:
                out.append(make(group, indices, wanted))
    return out


_MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "ns_steps": 5,
                  "nesterov": True}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}


class MuonWithAuxAdam(ChunkedOptimizer):
    """Muon for the groups marked ``use_muon=True``, AdamW for the others (DeepSpeed's class name).

    Args:
        param_groups: dicts with ``params`` and ``use_muon``; missing hyperparameters take
            DeepSpeed's defaults (Muon: lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram",
            plus ns_steps 5, nesterov True; AdamW: lr 3e-4, betas (0.9, 0.95), eps 1e-10,
            weight_decay 0).
        layouts: per group, how its (single, flat) tensor holds the group's parameters (ZeRO);
            None, or None for a group, means each tensor of the group is one parameter.
        gather: all-gathers a flat shard into the whole group (ZeRO stages that shard the master);
            with it ``step()`` is a collective.

    Raises:
        ValueError: a group without ``use_muon``, an unknown ``ns_method``, or a Muon tensor with
            fewer than 2 dimensions.
    """

    def __init__(self, param_groups: Iterable[dict[str, Any]],
                 layouts: Sequence[GroupLayout | None] | None = None, gather: Gather | None = None):
        groups = [dict(g) for g in param_groups]
        for g in groups:
            if "use_muon" not in g:
                raise ValueError("every MuonWithAuxAdam param group needs use_muon=True or False")
            for key, value in (_MUON_DEFAULTS if g["use_muon"] else _ADAM_DEFAULTS).items():
                g.setdefault(key, value)
            if g["use_muon"] and g["ns_method"] not in NS_METHODS:
                raise ValueError(f"ns_method must be one of {', '.join(NS_METHODS)}, got {g['ns_method']!r}")
        super().__init__(groups, {})
        self.layouts = list(layouts) if layouts is not None else [None] * len(self.param_groups)
        self.gather = gather

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        if group["use_muon"]:
            for p in params:
                self._muon_step(p, group, self.layouts[index])
        else:
            for p in params:
                self._adam_step(p, group)

    def _muon_step(self, p: torch.Tensor, group: dict[str, Any], layout: GroupLayout | None) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        m = state["momentum_buffer"]
        u = _mixed(self._unscaled([p.grad])[0], m, group["momentum"], group["nesterov"])
        steps, method = group["ns_steps"], group["ns_method"]
        if layout is None:
            update = orthogonalized_update(u.view(p.shape), steps, method)
        else:
            update = self._flat_update(u, layout, steps, method)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    def _flat_update(self, u: torch.Tensor, layout: GroupLayout, steps: int, method: str) -> torch.Tensor:
        """The update of this rank's [start, end) of a flat group, from whole matrices."""
        whole = self.gather(u, layout) if self.gather is not None else u
        base = 0 if self.gather is not None else layout.start  # where `whole` starts in the group
        update = torch.zeros_like(u)
        for i, shape in enumerate(layout.shapes):
            a, b = layout.param_range(i)
            lo, hi = max(a, layout.start), min(b, layout.end)
            if hi <= lo:
                continue  # held by other ranks only
            o = orthogonalized_update(whole[a - base:b - base].view(shape), steps, method)
            update[lo - layout.start:hi - layout.start] = o.reshape(-1)[lo - a:hi - a]
        return update

    def _adam_step(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        step = self._count_step(p)
        g = self._unscaled([p.grad])[0]
        beta1, beta2 = group["betas"]
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].lerp_(g.square(), 1 - beta2)
        denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))

