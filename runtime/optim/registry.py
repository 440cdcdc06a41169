"""Optimizers named by ds_config's ``optimizer.type`` (case-insensitive), with DeepSpeed's params.

Owns the registry ``optimizer.type`` -> (accepted ``optimizer.params`` with defaults, factory).
``validate_optimizer`` checks a config without tensors (called when the config is parsed);
``build_optimizer`` makes the ``torch.optim.Optimizer`` over the engine's param groups.

Types: ``Adam`` / ``AdamW`` (DeepSpeed's FusedAdam params; ``adam_w_mode`` defaults to true, so
``Adam`` means decoupled weight decay unless it is set false; ``AdamW`` is always decoupled),
``SGD``, ``Adagrad``, ``Lion`` (``lion.py``), ``Lamb`` (``lamb.py``) and ``Muon`` (``muon.py``:
Muon for hidden matrices, AdamW for the rest, in separate param groups made by ``split_groups``);
like DeepSpeed, any other
``torch.optim`` class by its exact name (``RMSprop``, ``NAdam``, ...). torch's optimizers are
built with ``fused=True`` when the parameters allow it (CPU included: 3-10x faster than the
per-tensor loop), else ``foreach=True``; the registered ones as ``torch_optimizers`` subclasses,
whose update goes through ``dslaunch.kernels`` (as Lion's and Adam's without bias correction).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean, quote
from dslaunch.runtime.config.param_schema import (
    REQUIRED,
    Option,
    betas,
    boolean,
    check_params,
    choice,
    describe,
    finite,
    integer,
    number,
)

__all__ = ["OptimizerSpec", "OPTIMIZER_TYPES", "validate_optimizer", "build_optimizer", "is_compressed",
           "sees_flat_shards", "split_groups"]

_KEY = "optimizer.params"


@dataclass(frozen=True)
class OptimizerSpec:
    """A validated optimizer config: canonical type name and complete keyword arguments."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)


def _no_cross_check(p: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class _Entry:
    name: str
    schema: Mapping[str, Option]
    factory: Callable[[Any, dict[str, Any], str], Any]
    # Checks between keys, run at validation time (no tensors needed).
    cross_check: Callable[[dict[str, Any]], None] = _no_cross_check
    # Needs to know how flat ZeRO tensors map to the original parameters (per-parameter norms).
    layout_aware: bool = False
    # Exchanges its own state in compressed form after a warm-up: the strategy gets a
    # zero.exchange.CompressedExchange, which the factory receives as params["exchange"].
    compressed: bool = False
    # Needs whole matrices (Muon): the factory gets the groups' GroupLayouts and a gather over the
    # data-parallel group; the engine splits its param groups with ``split`` first.
    matrix_aware: bool = False
    split: Callable[[Any, Callable[[Any, list[int], bool], Any]], list[Any]] | None = None


# eps = 0 divides 0 by 0 on a parameter whose gradient is still zero: NaN weights.
_EPS = number(0.0, low_open=True)


def _adam_schema() -> dict[str, Option]:
    return {
        "lr": Option(1e-3, number(0.0)),
        "betas": Option((0.9, 0.999), betas),
        "eps": Option(1e-8, _EPS),
        "weight_decay": Option(0.0, number(0.0)),
        "bias_correction": Option(True, boolean),
        "amsgrad": Option(False, boolean),
        "adam_w_mode": Option(True, boolean),
        "torch_adam": Option(False, boolean),
    }


def _torch_optimizer(cls: type, param_groups: Any, kwargs: dict[str, Any]) -> Any:
    """``cls(..., fused=True)`` if torch supports it for these tensors, else foreach, else plain."""
    groups = _materialize(param_groups)
    for flag in ("fused", "foreach"):
        try:
            return cls(groups, **kwargs, **{flag: True})
        except (RuntimeError, ValueError, TypeError):
            continue  # e.g. fused kernels missing for this device or dtype
    return cls(groups, **kwargs)


def _materialize(param_groups: Any) -> list[Any]:
    # A generator (model.parameters()) would be exhausted by a failed first attempt.
    groups = list(param_groups)
    return [dict(g) if isinstance(g, Mapping) else g for g in groups]


def _make_adam(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim import torch_optimizers

    # DeepSpeed: type AdamW is always decoupled; type Adam is decoupled unless adam_w_mode=false.
    decoupled = type_name == "AdamW" or p["adam_w_mode"]
    if not p["bias_correction"]:  # torch's Adam always corrects: use ours
        from dslaunch.runtime.optim.adam import Adam

        kwargs = {k: p[k] for k in ("lr", "betas", "eps", "weight_decay")}
        return Adam(_materialize(param_groups), **kwargs, bias_correction=False, adam_w_mode=decoupled)
    cls = torch_optimizers.AdamW if decoupled else torch_optimizers.Adam
    kwargs = {k: p[k] for k in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
    # torch_adam picks torch's implementation in DeepSpeed; torch's is what we always use.
    return _torch_optimizer(cls, param_groups, kwargs)


def _make_sgd(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim.torch_optimizers import SGD

    return _torch_optimizer(SGD, param_groups, dict(p))


def _make_adagrad(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim.torch_optimizers import Adagrad

    return _torch_optimizer(Adagrad, param_groups, dict(p))


def _make_lion(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim.lion import Lion

    return Lion(_materialize(param_groups), **p)


def _make_lamb(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim.lamb import Lamb

    del p["amsgrad"]  # always false here (cross-checked)
    return Lamb(_materialize(param_groups), **p)


# DeepSpeed's comm_backend_name values; what runs here goes through dslaunch.comm on the data-parallel
# group's own backend (gloo or NCCL), so "nccl" also runs on gloo.
_ONEBIT_BACKENDS = {"nccl": True, "gloo": True, "mpi": False, "hccl": False, "compressed": False}


def _onebit_schema() -> dict[str, Option]:
    return {**_adam_schema(), "freeze_step": Option(100000, integer(1)),
            "cuda_aware": Option(False, boolean), "comm_backend_name": Option("nccl", _comm_backend),
            "eps_inside_sqrt": Option(False, boolean)}


def _comm_backend(path: str, value: Any) -> str:
    if not isinstance(value, str) or value not in _ONEBIT_BACKENDS:
        raise ConfigError(f"must be one of {', '.join(_ONEBIT_BACKENDS)}, got {describe(value)}", key=path)
    if not _ONEBIT_BACKENDS[value]:
        raise ConfigError(f"{quote(value)} cannot run here (dslaunch exchanges through torch.distributed: "
                          "use \"nccl\" or \"gloo\", which run on the process group's backend)", key=path)
    return value


def _make_onebit_adam(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from functools import partial

    from dslaunch.runtime.optim.onebit import OneBitAdam

    exchange = p.pop("exchange")
    kwargs = {k: p[k] for k in ("lr", "betas", "eps", "weight_decay")}
    return _torch_optimizer(partial(OneBitAdam, exchange=exchange, freeze_step=p["freeze_step"],
                                    process_group=exchange.pg), param_groups, kwargs)


def _make_zero_one_adam(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from functools import partial

    from dslaunch.runtime.optim.zero_one_adam import ZeroOneAdam

    exchange = p.pop("exchange")
    kwargs = {k: p[k] for k in ("lr", "betas", "eps", "weight_decay")}
    schedule = {k: p[k] for k in ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")}
    return _torch_optimizer(partial(ZeroOneAdam, exchange=exchange, process_group=exchange.pg, **schedule),
                            param_groups, kwargs)


def _zero_one_schema() -> dict[str, Option]:
    schema = {k: v for k, v in _onebit_schema().items() if k != "freeze_step"}
    return {**schema, "var_freeze_step": Option(100000, integer(1)), "var_update_scaler": Option(16, integer(1)),
            "local_step_scaler": Option(32678, integer(1)), "local_step_clipper": Option(16, integer(1))}


def _make_onebit_lamb(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim.onebit import OneBitLamb

    exchange = p.pop("exchange")
    for key in ("amsgrad", "cuda_aware", "comm_backend_name"):
        del p[key]  # checked; nothing to pass on
    return OneBitLamb(_materialize(param_groups), exchange=exchange, process_group=exchange.pg, **p)


def _onebit_lamb_schema() -> dict[str, Option]:
    schema = {k: v for k, v in _onebit_schema().items() if k not in ("adam_w_mode", "torch_adam")}
    return {**schema, "max_coeff": Option(10.0, number(0.0)), "min_coeff": Option(0.01, number(0.0)),
            "coeff_beta": Option(0.9, number(0.0, 1.0)), "factor_max": Option(4.0, number(0.0)),
            "factor_min": Option(0.5, number(0.0)), "factor_threshold": Option(0.1, number(0.0))}


def _check_onebit_lamb(p: dict[str, Any]) -> None:
    _check_lamb(p)
    if p["factor_min"] > p["factor_max"]:
        raise ConfigError(f"factor_min {p['factor_min']} is larger than factor_max {p['factor_max']}",
                          key=f"{_KEY}.factor_min")


def _check_onebit(p: dict[str, Any]) -> None:
    for key, ok in (("amsgrad", False), ("bias_correction", True), ("adam_w_mode", True),
                    ("eps_inside_sqrt", False)):
        if p[key] != ok:
            raise ConfigError(f"{str(p[key]).lower()} is not supported by the 1-bit optimizers (only "
                              f"{str(ok).lower()})", key=f"{_KEY}.{key}")


def _check_adam(p: dict[str, Any]) -> None:
    if p["amsgrad"] and not p["bias_correction"]:
        raise ConfigError("amsgrad together with bias_correction=false is not supported",
                          key=f"{_KEY}.amsgrad")


def _check_sgd(p: dict[str, Any]) -> None:
    if p["nesterov"] and (p["momentum"] <= 0.0 or p["dampening"] != 0.0):
        raise ConfigError("nesterov=true needs momentum > 0 and dampening = 0", key=f"{_KEY}.nesterov")


def _check_lamb(p: dict[str, Any]) -> None:
    if p["amsgrad"]:
        raise ConfigError("amsgrad is not supported by Lamb (DeepSpeed rejects it too)", key=f"{_KEY}.amsgrad")
    if p["min_coeff"] > p["max_coeff"]:
        raise ConfigError(f"min_coeff {p['min_coeff']} is larger than max_coeff {p['max_coeff']}",
                          key=f"{_KEY}.min_coeff")


def _muon_schema() -> dict[str, Option]:
    # lr / muon_lr / adam_lr left out: DeepSpeed's per-part defaults (muon 0.02, adam 3e-4) apply.
    rate = number(0.0, low_open=True)
    return {"lr": Option(None, rate), "muon_lr": Option(None, rate), "adam_lr": Option(None, rate),
            "momentum": Option(0.95, number(0.0, 1.0, high_open=True)), "weight_decay": Option(0.0, number(0.0)),
            "betas": Option((0.9, 0.95), betas), "eps": Option(1e-10, _EPS),
            "ns_method": Option("gram", choice("gram", "standard")), "ns_steps": Option(5, integer(1, 100)),
            "nesterov": Option(True, boolean)}


def _make_muon(param_groups: Any, p: dict[str, Any], type_name: str) -> Any:
    from dslaunch.runtime.optim.muon import MuonWithAuxAdam, is_muon_param

    layouts, gather = p.pop("group_layouts"), p.pop("gather")
    groups = _materialize(param_groups)
    if groups and not isinstance(groups[0], Mapping):  # bare tensors (not from the engine): by shape
        groups = [{"params": [t for t in groups if is_muon_param("", t) == flag], "use_muon": flag}
                  for flag in (True, False)]
        groups = [g for g in groups if g["params"]]
    keys = {True: ("momentum", "weight_decay", "ns_method", "ns_steps", "nesterov"),
            False: ("betas", "eps", "weight_decay")}
    built = []
    for g in groups:
        muon = bool(g.get("use_muon", False))
        config = {k: p[k] for k in keys[muon]}
        lr = p["muon_lr" if muon else "adam_lr"] or p["lr"]
        if lr is not None:
            config["lr"] = lr
        built.append({**config, **g, "use_muon": muon})  # a group's own keys win, as in torch
    return MuonWithAuxAdam(built, layouts=layouts, gather=gather)


def _split_muon(groups: Any, make: Callable[[Any, list[int], bool], Any]) -> list[Any]:
    from dslaunch.runtime.optim.muon import split_muon_groups

    try:
        return split_muon_groups(groups, make)
    except ValueError as e:
        raise ConfigError(str(e), key="optimizer.type") from None


_ENTRIES = [
    _Entry("Adam", _adam_schema(), _make_adam, _check_adam),
    _Entry("AdamW", _adam_schema(), _make_adam, _check_adam),
    _Entry("SGD", {
        "lr": Option(1e-3, number(0.0)),
        "momentum": Option(0.0, number(0.0)),
        "dampening": Option(0.0, number()),
        "weight_decay": Option(0.0, number(0.0)),
        "nesterov": Option(False, boolean),
        "maximize": Option(False, boolean),
    }, _make_sgd, _check_sgd),
    _Entry("Adagrad", {
        "lr": Option(1e-2, number(0.0)),
        "lr_decay": Option(0.0, number(0.0)),
        "weight_decay": Option(0.0, number(0.0)),
        "initial_accumulator_value": Option(0.0, number(0.0)),
        "eps": Option(1e-10, _EPS),
        "maximize": Option(False, boolean),
    }, _make_adagrad),
    _Entry("Lion", {
        "lr": Option(1e-3, number(0.0)),
        "betas": Option((0.9, 0.999), betas),
        "weight_decay": Option(0.0, number(0.0)),
    }, _make_lion),
    _Entry("Lamb", {
        "lr": Option(1e-3, number(0.0)),
        "betas": Option((0.9, 0.999), betas),
        "eps": Option(1e-8, _EPS),
        "weight_decay": Option(0.0, number(0.0)),
        "bias_correction": Option(True, boolean),
        "max_coeff": Option(10.0, number(0.0)),
        "min_coeff": Option(0.01, number(0.0)),
        "eps_inside_sqrt": Option(False, boolean),
        "amsgrad": Option(False, boolean),
    }, _make_lamb, _check_lamb, layout_aware=True),
    _Entry("Muon", _muon_schema(), _make_muon, matrix_aware=True, split=_split_muon),
    _Entry("OneBitAdam", _onebit_schema(), _make_onebit_adam, _check_onebit, compressed=True),
    _Entry("ZeroOneAdam", _zero_one_schema(), _make_zero_one_adam, _check_onebit, compressed=True),
    _Entry("OneBitLamb", _onebit_lamb_schema(), _make_onebit_lamb, _check_onebit_lamb, layout_aware=True,
           compressed=True),
]
_REGISTRY = {entry.name.lower(): entry for entry in _ENTRIES}

OPTIMIZER_TYPES: tuple[str, ...] = tuple(entry.name for entry in _ENTRIES)


# Types DeepSpeed knows that dslaunch does not implement.
_DEEPSPEED_ONLY = ("MuAdam", "MuAdamW", "MuSGD")


def _entry(opt_type: str) -> _Entry:
    if not isinstance(opt_type, str):
        raise ConfigError(f"must be a string such as \"AdamW\", got {describe(opt_type)}", key="optimizer.type")
    entry = _REGISTRY.get(opt_type.lower()) or _torch_entry(opt_type)
    if entry is not None:
        return entry
    if opt_type.lower() in {name.lower() for name in _DEEPSPEED_ONLY}:
        raise ConfigError(f"optimizer type {quote(opt_type)} is accepted by DeepSpeed but not implemented by "
                          f"dslaunch; use one of {', '.join(OPTIMIZER_TYPES)} or pass the optimizer to "
                          "initialize()", key="optimizer.type")
    hint = did_you_mean(opt_type.lower(), _REGISTRY)
    raise ConfigError(f"unknown optimizer type {quote(opt_type)}{hint}; valid types (case-insensitive): "
                      f"{', '.join(OPTIMIZER_TYPES)}, any other torch.optim class by its exact name "
                      "(e.g. RMSprop), or pass a torch optimizer to initialize()", key="optimizer.type")


def _torch_entry(opt_type: str) -> _Entry | None:
    """DeepSpeed's fallback: any other ``torch.optim`` class by its exact name (e.g. ``RMSprop``).

    Its keyword arguments become the accepted params (so typos are still caught); values are
    passed through as given. torch is imported only here, for names outside the registry.
    """
    import inspect

    import torch

    cls = getattr(torch.optim, opt_type, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        return None
    schema = {}
    for name, arg in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params") or arg.kind in (arg.VAR_POSITIONAL, arg.VAR_KEYWORD):
            continue
        schema[name] = Option(REQUIRED if arg.default is arg.empty else _UNSET, _json_value)
    return _Entry(cls.__name__, schema, lambda groups, p, _name: cls(
        _materialize(groups), **{k: v for k, v in p.items() if v is not _UNSET}))


# Marks a torch keyword argument the user left out: torch applies its own default.
_UNSET: Any = type("_Unset", (), {"__repr__": lambda self: "<torch default>"})()


def _json_value(path: str, value: Any) -> Any:
    # JSON has no tuples; torch's betas and etas are tuples. torch owns the ranges, but checks
    # `lr < 0` at most: a NaN or inf would train silently to NaN weights.
    value = finite(path, value)
    return tuple(value) if isinstance(value, list) else value


def validate_optimizer(opt_type: str, params: Mapping[str, Any] | None) -> OptimizerSpec:
    """Check ``optimizer.type`` and ``optimizer.params`` without building anything.

    Args:
        opt_type: ds_config ``optimizer.type``, case-insensitive (``"adamw"`` == ``"AdamW"``).
        params: ds_config ``optimizer.params`` (``None`` = all defaults).

    Returns:
        The canonical type name and the complete parameters, defaults filled in.

    Raises:
        ConfigError: unknown type (valid ones listed, did-you-mean), unknown parameter named
            ``optimizer.params.<key>`` with did-you-mean, wrong type or range, or an
            unsupported combination.
    """
    entry = _entry(opt_type)
    if isinstance(params, Mapping) and "max_grad_norm" in params:
        raise ConfigError("gradient clipping is configured by the top-level 'gradient_clipping' key, "
                          "not as an optimizer parameter", key=f"{_KEY}.max_grad_norm")
    checked = check_params(params, entry.schema, _KEY, f"optimizer {entry.name!r}")
    entry.cross_check(checked)
    return OptimizerSpec(entry.name, checked)


def is_compressed(spec: OptimizerSpec | None) -> bool:
    """Whether ``spec`` names a 1-bit optimizer (the strategy needs a ``CompressedExchange``)."""
    return spec is not None and _entry(spec.name).compressed


def sees_flat_shards(spec: OptimizerSpec | None) -> bool:
    """Whether ``spec``'s optimizer reads more than its own elements of the flat shards (per-parameter
    norms, whole matrices, its own compressed exchange): it assumes every group shards over the
    data-parallel group."""
    entry = _entry(spec.name) if spec is not None else None
    return entry is not None and (entry.layout_aware or entry.matrix_aware or entry.compressed)


def split_groups(spec: OptimizerSpec | None, groups: list[Any], make: Callable[[Any, list[int], bool], Any]
                 ) -> list[Any]:
    """The engine's param groups as ``spec``'s optimizer wants them before they are flattened:
    Muon's split into Muon and AdamW parts (``muon.split_muon_groups``), else unchanged."""
    entry = _entry(spec.name) if spec is not None else None
    return entry.split(groups, make) if entry is not None and entry.split is not None else groups


def build_optimizer(spec: OptimizerSpec, param_groups: Any, *,
                    flat_layouts: Sequence[Any] | None = None,
                    norm_all_reduce: Callable[[Any], None] | None = None, exchange: Any = None,
                    group_layouts: Sequence[Any] | None = None, gather: Callable[..., Any] | None = None):
    """Build the optimizer DeepSpeed would build for this ``optimizer`` section.

    Args:
        spec: from ``validate_optimizer`` (done once, when the config was parsed).
        param_groups: an iterable of tensors or of param-group dicts (per-group keys such as
            ``weight_decay`` override the config's values, as in torch).
        flat_layouts: for ZeRO's flat tensors, one ``zero.partition.FlatLayout`` (or None) per group:
            which original parameters each flat tensor holds. Only optimizers whose update
            depends on per-parameter norms (Lamb) use it; elementwise ones ignore it.
        norm_all_reduce: in-place sum over the ranks when each holds a shard of the flat
            tensors (ZeRO stage >= 1); with Lamb this makes ``step()`` a collective.
        group_layouts, gather: for optimizers that need whole matrices (Muon), each group's
            ``zero.partition.GroupLayout`` and the all-gather of a shard over the ranks (None when
            each rank holds whole groups); with a gather, Muon's ``step()`` is a collective.

    Returns:
        A ``torch.optim.Optimizer``.
    """
    entry = _entry(spec.name)
    kwargs = dict(spec.params)
    if entry.layout_aware:
        kwargs.update(flat_layouts=flat_layouts, norm_all_reduce=norm_all_reduce)
    if entry.matrix_aware:
        kwargs.update(group_layouts=group_layouts, gather=gather)
    if entry.compressed:
        if exchange is None:
            raise ConfigError(f"optimizer {spec.name!r} runs only inside the engine (it needs the ZeRO "
                              "strategy's compressed gradient exchange)", key="optimizer.type")
        kwargs["exchange"] = exchange
    return entry.factory(param_groups, kwargs, spec.name)
