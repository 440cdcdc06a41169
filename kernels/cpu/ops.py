"""Python entry points of the C kernels, threads = torch's.

``adam_many``, ``adagrad_many`` and ``lion_many`` update lists of contiguous fp32 CPU tensors and
their states in place in one C call per dtype pair (``adam``, ``adagrad``, ``lion``: one tensor);
``grad_sumsq`` reduces one gradient (``fold_sumsq``: while writing it); the dispatch-op functions below them take the op signatures of
``dslaunch.kernels`` (lists of tensors, or a torch optimizer) and hand any tensor the C code
does not take (not fp32, not contiguous, not on the CPU) to the torch reference.

Limitations: the library must be loadable (``build.available()``); the dispatch point checks it
before handing out these functions.
"""

from __future__ import annotations

import array
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from dslaunch.kernels.cpu.build import library

__all__ = ["adam", "adagrad", "lion", "adam_many", "adagrad_many", "lion_many", "grad_sumsq", "fold_sumsq", "copy_out",
           "stream", "stream_read", "takes", "adam_op", "cpu_adam_op", "lion_op", "adagrad_op",
           "advise_huge_pages"]

# Dtype codes of optim.c (a parameter copy of code 0 means "no copy").
_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_OUT_CODES = {torch.bfloat16: 1, torch.float16: 2}
_F32, _STRIDED = torch.float32, torch.strided
# adam_many's roundings, by optim.c's code (its dsl_adam ``deepspeed`` flag).
_ASSOCIATIONS = ("torch", "deepspeed")


def takes(*tensors: torch.Tensor | None) -> bool:
    """Whether the C kernels can run on these tensors as they are (fp32, contiguous, CPU, dense)."""
    # A plain loop and is_cpu (not device.type, which builds a device: 0.6 us): this runs for
    # every tensor of every step, and a model can have thousands of small ones.
    for t in tensors:
        if t is not None and not (t.dtype is _F32 and _dense(t)):
            return False
    return True


def _grad_code(grad: torch.Tensor) -> int:
    if grad.dtype not in _CODES or not _dense(grad):
        raise ValueError(f"gradient must be a contiguous fp32/bf16/fp16 CPU tensor, got {grad.dtype} "
                         f"on {grad.device} (contiguous={_contiguous(grad)})")
    return _CODES[grad.dtype]


def _dense(t: torch.Tensor) -> bool:
    """On the CPU, strided and contiguous: what the C kernels read and write as it is."""
    return t.is_cpu and _contiguous(t)


def _contiguous(t: torch.Tensor) -> bool:
    return t.layout is _STRIDED and t.is_contiguous()  # layout first: is_contiguous raises on sparse


def _lib() -> Any:
    lib = library()
    if lib is None:
        raise RuntimeError("dslaunch's CPU kernels are unavailable (see the warning above)")
    return lib


Column = Sequence[torch.Tensor | None]
Row = tuple[torch.Tensor | None, ...]  # (param, grad, state 1, state 2, 16-bit copy); Nones after grad
Tables = dict[tuple[int, int], array.array]


def _tables(params: Column, grads: Column, s1: Column, s2: Column,
            outs: Column | None) -> tuple[Tables, list[Row]]:
    """optim.c's row tables of the rows its kernels take as they are, and the other rows.

    A table holds the rows of one (gradient dtype, copy dtype) pair, six int64 each: the p, g, s1,
    s2 and copy addresses and the element count. Taken: a contiguous CPU fp32 parameter and
    states, an fp32/bf16/fp16 gradient, a bf16/fp16 copy. This is the only check a row gets: it
    runs once per tensor per step, for thousands of small tensors in some models.
    """
    outs = outs if outs is not None else [None] * len(params)
    tables: Tables = {}
    rest: list[Row] = []
    for row in zip(params, grads, s1, s2, outs, strict=True):
        p, g, a, b, out = row
        gdt = _CODES.get(g.dtype)
        odt = 0 if out is None else _OUT_CODES.get(out.dtype)
        if (gdt is None or odt is None or p.dtype is not _F32 or not _dense(p) or not _dense(g)
                or (a is not None and (a.dtype is not _F32 or not _dense(a)))
                or (b is not None and (b.dtype is not _F32 or not _dense(b)))
                or (out is not None and not _dense(out))):
            rest.append(row)
            continue
        table = tables.get((gdt, odt))
        if table is None:
            table = tables[gdt, odt] = array.array("q")  # not a ctypes array: 100x cheaper to build
        table.extend((p.data_ptr(), g.data_ptr(), 0 if a is None else a.data_ptr(),
                      0 if b is None else b.data_ptr(), 0 if out is None else out.data_ptr(), p.numel()))
    return tables, rest


def _taken(tables: Tables, rest: list[Row], partial: bool) -> Iterator[tuple[int, int, int, int]]:
    """(table address, rows, gdt, odt) of each table; the rest refused unless ``partial``. An
    address is valid while ``tables`` lives."""
    if rest and not partial:
        raise ValueError("the CPU kernels take contiguous fp32 CPU parameters and states, fp32/bf16/fp16 "
                         f"gradients and bf16/fp16 copies; got {_describe(rest[0])}")
    for (gdt, odt), table in tables.items():
        yield table.buffer_info()[0], len(table) // 6, gdt, odt


def _describe(row: Row) -> str:
    names = ("parameter", "gradient", "state", "state", "copy")
    return ", ".join(f"{n} {t.dtype} on {t.device} (contiguous={_contiguous(t)})"
                     for n, t in zip(names, row, strict=True) if t is not None)


def adam_many(params: Column, grads: Column, exp_avgs: Column, exp_avg_sqs: Column, *, step: int, lr: float,
              beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction: bool = True,
              adamw_mode: bool = True, grad_mul: float = 1.0, grad_div: float = 1.0,
              outs: Column | None = None, partial: bool = False, association: str = "torch") -> list[Row]:
    """One Adam/AdamW step of flat fp32 ``params`` (1-based ``step``), in place, in one call per
    gradient/copy dtype pair (so a list of small tensors costs one call, not one each).

    ``association``: ``"torch"`` rounds as torch's fused AdamW (bit for bit on AVX2);
    ``"deepspeed"`` as DeepSpeed's ``DeepSpeedCPUAdam`` (one division per element, not two).

    ``grads`` may be fp32, bf16 or fp16 and are multiplied by ``grad_mul`` and divided by
    ``grad_div`` first (torch's fused optimizers divide by ``grad_scale``: dividing here rounds
    the same); ``outs`` (bf16 or fp16 tensors, or None) receive the updated parameters in the
    same pass.

    Returns:
        The (param, grad, exp_avg, exp_avg_sq, out) rows the kernel does not take as they are (not
        contiguous, not fp32, not on the CPU), left unchanged; with ``partial=False`` there must
        be none (ValueError naming the first).
    """
    if association not in _ASSOCIATIONS:
        raise ValueError(f"association must be one of {', '.join(_ASSOCIATIONS)}, not {association!r}")
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if bias_correction else (1.0, 1.0)
    tables, rest = _tables(params, grads, exp_avgs, exp_avg_sqs, outs)
    for table, count, gdt, odt in _taken(tables, rest, partial):
        # Coefficients in double, rounded once to fp32, as torch's fused Adam computes them.
        _lib().dsl_adam(table, count, gdt, odt, beta1, 1.0 - beta1, beta2, 1.0 - beta2, eps, weight_decay,
                        lr * weight_decay, 1.0 - lr * weight_decay, lr / bc1, math.sqrt(bc2),
                        1.0 / math.sqrt(bc2), grad_mul, grad_div, int(adamw_mode),
                        _ASSOCIATIONS.index(association), torch.get_num_threads())
    return rest


def adagrad_many(params: Column, grads: Column, state_sums: Column, *, clr: float, eps: float,
                 weight_decay: float, grad_mul: float = 1.0, grad_div: float = 1.0,
                 outs: Column | None = None, partial: bool = False) -> list[Row]:
    """One Adagrad step (torch's, at the current learning rate ``clr``) of each tensor, in place;
    the arguments other than the states, and what it returns, as ``adam_many``'s."""
    tables, rest = _tables(params, grads, state_sums, [None] * len(params), outs)
    for table, count, gdt, odt in _taken(tables, rest, partial):
        _lib().dsl_adagrad(table, count, gdt, odt, clr, eps, weight_decay, grad_mul, grad_div,
                           torch.get_num_threads())
    return rest


def lion_many(params: Column, grads: Column, exp_avgs: Column, *, lr: float, beta1: float, beta2: float,
              weight_decay: float, grad_mul: float = 1.0, outs: Column | None = None,
              partial: bool = False) -> list[Row]:
    """One Lion step of each tensor, in place; ``grads``, ``grad_mul``, ``outs``, ``partial`` and
    what it returns as ``adam_many``'s."""
    tables, rest = _tables(params, grads, exp_avgs, [None] * len(params), outs)
    for table, count, gdt, odt in _taken(tables, rest, partial):
        _lib().dsl_lion(table, count, gdt, odt, lr, 1.0 - beta1, 1.0 - beta2, 1.0 - lr * weight_decay,
                        grad_mul, torch.get_num_threads())
    return rest


def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
         out: torch.Tensor | None = None, **kwargs: Any) -> None:
    """``adam_many`` of one tensor; ``out`` is its 16-bit copy (or None)."""
    adam_many([param], [grad], [exp_avg], [exp_avg_sq], outs=[out], **kwargs)


def adagrad(param: torch.Tensor, grad: torch.Tensor, state_sum: torch.Tensor, *,
            out: torch.Tensor | None = None, **kwargs: Any) -> None:
    """``adagrad_many`` of one tensor."""
    adagrad_many([param], [grad], [state_sum], outs=[out], **kwargs)


def lion(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, out: torch.Tensor | None = None,
         **kwargs: Any) -> None:
    """``lion_many`` of one tensor."""
    lion_many([param], [grad], [exp_avg], outs=[out], **kwargs)


def grad_sumsq(grad: torch.Tensor, grad_mul: float = 1.0) -> float:
    """Sum of squares of ``grad * grad_mul`` in double: inf or NaN iff a gradient is inf/NaN."""
    return _lib().dsl_grad_sumsq(grad.data_ptr(), _grad_code(grad), grad.numel(), grad_mul,
                                 torch.get_num_threads())


_FOLD_MODES = {None: 0, "copy": 1, "add": 2}


def fold_sumsq(dst: torch.Tensor, src: torch.Tensor | None = None, mode: str | None = None) -> float:
    """Sum of squares of the contiguous fp32 CPU ``dst`` in double, after (``mode``) ``"copy"``:
    ``dst = src`` or ``"add"``: ``dst += src`` in the same pass (``src`` fp32/bf16/fp16, as many
    elements). Its order depends only on ``dst.numel()``: fused or not, at any thread count, the
    same values give the same bits."""
    if not (dst.dtype is _F32 and _dense(dst)):
        raise ValueError(f"fold_sumsq writes a contiguous fp32 CPU tensor, got {dst.dtype} on {dst.device}")
    code = 0 if src is None else _grad_code(src)
    if src is not None and src.numel() != dst.numel():
        raise ValueError(f"fold_sumsq: {src.numel()} source elements for {dst.numel()} destination elements")
    out = _lib().dsl_fold_sumsq(dst.data_ptr(), None if src is None else src.data_ptr(), code, dst.numel(),
                                _FOLD_MODES[mode if src is not None else None], torch.get_num_threads())
    return out


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks the OS to back ``t``'s whole 2 MiB pages with huge pages; for a tensor not yet touched
    (``torch.empty``), before it is written. Whether the advice was taken (not where THP is off)."""
    return _lib().dsl_advise_huge(t.data_ptr(), t.numel() * t.element_size()) == 0


def copy_out(param: torch.Tensor, out: torch.Tensor) -> None:
    """``out.copy_(param)`` for a bf16/fp16 ``out`` (round to nearest even, as torch)."""
    _lib().dsl_copy_out(param.data_ptr(), out.data_ptr(), _copy_code(out), param.numel(),
                        torch.get_num_threads())


def _copy_code(out: torch.Tensor) -> int:
    if out.dtype not in _OUT_CODES or not _dense(out):
        raise ValueError(f"the parameter copy must be a contiguous bf16/fp16 CPU tensor, got {out.dtype} "
                         f"on {out.device}")
    return _OUT_CODES[out.dtype]


def stream(param: torch.Tensor, grad: torch.Tensor, states: Sequence[torch.Tensor],
           out: torch.Tensor | None = None) -> None:
    """The streaming bound of an update: the same reads and in-place writes as an update of
    ``param`` with these (one or two) ``states`` and optional copy, one add per tensor instead of
    the optimizer's arithmetic (changes the tensors: for benchmarks)."""
    s1, s2 = (*states, None, None)[:2]
    for table, count, gdt, odt in _taken(*_tables([param], [grad], [s1], [s2], [out]), partial=False):
        _lib().dsl_stream(table, count, gdt, odt, torch.get_num_threads())


def stream_read(grad: torch.Tensor) -> float:
    """The streaming bound of ``grad_sumsq``: the same reads, one add per element."""
    return _lib().dsl_stream_read(grad.data_ptr(), _grad_code(grad), grad.numel(), torch.get_num_threads())


# ------------------------------------------------------------------- the dispatch ops "adam", "lion"

def adam_op(*lists: list[torch.Tensor], **hyper: Any) -> None:
    """The fused ``"adam"`` op of ``dslaunch.kernels`` (signature in its docstring): torch's rounding."""
    _adam(lists, hyper, "torch")


def cpu_adam_op(*lists: list[torch.Tensor], **hyper: Any) -> None:
    """The fused ``"cpu_adam"`` op (``"adam"``'s signature): DeepSpeed's rounding."""
    _adam(lists, hyper, "deepspeed")


def _adam(lists: Sequence[list[torch.Tensor]], hyper: dict[str, Any], association: str) -> None:
    """``adam_many`` of the op's (params, grads, exp_avgs, exp_avg_sqs) and keyword arguments; the
    rows it does not take go to the op's reference."""
    h = hyper
    rest = adam_many(*lists, step=h["step"], lr=h["lr"], beta1=h["betas"][0], beta2=h["betas"][1],
                     eps=h["eps"], weight_decay=h["weight_decay"], bias_correction=h["bias_correction"],
                     adamw_mode=h["adam_w_mode"], grad_mul=_mul(h["inv_scale"]), partial=True,
                     association=association)
    if rest:
        from dslaunch.kernels import dispatch

        reference = dispatch.KERNELS.get("adam" if association == "torch" else "cpu_adam", "cpu", "reference")
        reference(*_columns(rest, 4), **{k: v for k, v in hyper.items() if k != "chunk_numel"})


def lion_op(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], *,
            lr: float, betas: tuple[float, float], weight_decay: float, inv_scale: float | None,
            chunk_numel: int | None = None) -> None:
    """The fused ``"lion"`` op of ``dslaunch.kernels``."""
    rest = lion_many(params, grads, exp_avgs, lr=lr, beta1=betas[0], beta2=betas[1],
                     weight_decay=weight_decay, grad_mul=_mul(inv_scale), partial=True)
    if rest:
        from dslaunch.kernels.reference import lion_update

        lion_update(*_columns(rest, 3), lr=lr, betas=betas, weight_decay=weight_decay,
                    inv_scale=inv_scale)


def adagrad_op(params: list[torch.Tensor], grads: list[torch.Tensor], state_sums: list[torch.Tensor], *,
               clr: float, eps: float, weight_decay: float, inv_scale: float | None) -> None:
    """The fused ``"adagrad"`` op of ``dslaunch.kernels``."""
    rest = adagrad_many(params, grads, state_sums, clr=clr, eps=eps, weight_decay=weight_decay,
                        grad_mul=_mul(inv_scale), partial=True)
    if rest:
        from dslaunch.kernels.reference import adagrad_update

        adagrad_update(*_columns(rest, 3), clr=clr, eps=eps, weight_decay=weight_decay,
                       inv_scale=inv_scale)


def _mul(inv_scale: float | None) -> float:
    return 1.0 if inv_scale is None else float(inv_scale)


def _columns(rows: list[Row], n: int) -> list[list[Any]]:
    """The first ``n`` columns of ``rows``, as lists (the reference's arguments)."""
    return [[row[i] for row in rows] for i in range(n)]
