"""The flops profiler's tables as text: the step summary, the top modules per depth, and the
module tree. Pure formatting of a ``Profile`` (and, from the engine, a ``StepTiming``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ModuleRow", "Profile", "StepTiming", "summary_lines", "aggregated_lines", "detailed_lines",
           "number_to_string", "flops_to_string", "macs_to_string", "params_to_string", "duration_to_string"]

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, ""))
_SECONDS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"))


def _scaled(num: float, units: str | None, precision: int, unit: str) -> str:
    if units is None:
        scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(num) >= s), _PREFIXES[-1])
    else:
        found = [(s, p) for s, p in _PREFIXES if p == units]
        if not found:
            raise ValueError(f"units={units!r}: use one of T, G, M, K or ''")
        scale, prefix = found[0]
    if not prefix and float(num).is_integer():  # a count under 1000: no decimals
        return f"{int(num)} {unit}".rstrip()
    return f"{num / scale:.{precision}f} {prefix}{unit}".rstrip()


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``12345678 -> '12.35 M'``; ``units`` (T, G, M, K or "") fixes the prefix."""
    return _scaled(num, units, precision, "")


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return _scaled(flops, units, precision, "FLOPs")


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return _scaled(macs, units, precision, "MACs")


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return _scaled(params, units, precision, "")


def duration_to_string(duration: float, units: str | None = None, precision: int = 2) -> str:
    """Seconds as ``'76.67 ms'``; ``units`` (s, ms, us) fixes the unit."""
    scale, unit = next(((s, u) for s, u in _SECONDS if u == units), _SECONDS[-1]) if units is not None \
        else next(((s, u) for s, u in _SECONDS if duration >= s), _SECONDS[-1])
    return f"{duration / scale:.{precision}f} {unit}"


def _rate(flops: float, seconds: float) -> str:
    return _scaled(flops / seconds, None, 2, "FLOPS") if seconds > 0 else "n/a"


@dataclass(frozen=True)
class ModuleRow:
    """One module of the profiled model; flops include its children's."""

    name: str
    """Its path in the model (``h.0.attn``); the root is its class name."""
    type_name: str
    depth: int
    params: int
    fwd_flops: int
    bwd_flops: int
    own_fwd_flops: int
    own_bwd_flops: int
    fwd_duration: float
    calls: int


@dataclass(frozen=True)
class Profile:
    """What one profiled stretch counted on this rank."""

    rows: tuple[ModuleRow, ...]
    """The modules in ``named_modules()`` order (a parent before its children)."""
    outside_fwd: int
    outside_bwd: int
    """Flops of operators that ran outside every module of the model."""
    ops: tuple[tuple[str, int], ...]
    """Flops per aten operator, largest first."""
    bwd_measured: bool
    """A backward ran while counting; if not, ``bwd_flops`` is DeepSpeed's estimate."""
    recompute_fwd_factor: float = 0.0

    @property
    def fwd_flops(self) -> int:
        return self.outside_fwd + sum(r.own_fwd_flops for r in self.rows)

    @property
    def bwd_flops(self) -> int:
        if self.bwd_measured:
            return self.outside_bwd + sum(r.own_bwd_flops for r in self.rows)
        return round((2 + self.recompute_fwd_factor) * self.fwd_flops)

    @property
    def params(self) -> int:
        return self.rows[0].params if self.rows else 0


@dataclass(frozen=True)
class StepTiming:
    """The engine's side of a profiled optimizer step (from the event seam)."""

    step: int
    world_size: int
    dp_size: int
    mp_size: int
    micro_batch: int
    """``train_micro_batch_size_per_gpu`` (DeepSpeed's "batch size per GPU")."""
    micro_steps: int
    samples: int
    """Samples this rank processed in the step (micro batch x accumulation steps)."""
    fwd_s: float
    bwd_s: float
    allreduce_s: float
    step_s: float
    iter_s: float
    """Wall time from the first forward's start to the optimizer step's end."""
    model_params: int
    model_fwd_flops: int
    model_flops: int
    """Forward (and forward + backward) flops of the whole model: summed over the model-parallel
    group (None-free: a rank whose counting failed adds 0 and ``complete`` is False)."""
    mfu: str
    tokens_per_s: float | None = None
    complete: bool = True
    """Every rank of the model-parallel group counted its part."""


_NOTE = ("flops: matmul-like aten operators counted as run (matmuls, convolutions, RNN kernels, attention), "
         "1 MAC = 2 flops; bwd measured; model = summed over the model-parallel ranks (flops also over the "
         "sequence-parallel ranks); iter latency = first forward to step end")


def _line(label: str, value: object) -> str:
    """DeepSpeed's summary line: the label and ': ' padded to 70, two spaces, the value."""
    return f"{label + ': ':<70}  {value}"


def summary_lines(p: Profile, t: StepTiming | None, profile_step: int | None = None,
                  fwd_s: float | None = None) -> list[str]:
    """DeepSpeed's summary lines, in its order and with its names up to ``=`` or ``:`` (what a
    log parser reads), plus dslaunch's (measured backward, allreduce, MFU, tokens/s) after the
    line they belong with. Without an engine's ``t``: the counts and ``fwd_s`` (the model's
    forward time), as DeepSpeed's ``FlopsProfiler`` alone prints them.
    """
    fwd, bwd = p.fwd_flops, p.bwd_flops
    step = t.step if t is not None else profile_step
    bwd_label = "bwd flops per GPU (measured)" if p.bwd_measured else \
        f"bwd flops per GPU (estimated: (2 + {p.recompute_fwd_factor:g}) x fwd)"
    out = [f"{' dslaunch Flops Profiler ':-^78}",
           f"Profile Summary{f' at step {step}' if step is not None else ''}:", _NOTE]
    if t is not None:
        out += [_line("world size", t.world_size), _line("data parallel size", t.dp_size),
                _line("model parallel size", t.mp_size), _line("batch size per GPU", t.micro_batch),
                _line("gradient accumulation steps", t.micro_steps)]
    out.append(_line("params per GPU", params_to_string(p.params)))
    if t is not None:
        out.append(_line("params of model = params per GPU summed over mp ranks", _whole(t, t.model_params,
                                                                                       params_to_string)))
    out += [_line("fwd MACs per GPU", macs_to_string(fwd / 2)), _line("fwd flops per GPU", flops_to_string(fwd))]
    if t is not None:
        out.append(_line("fwd flops of model = fwd flops per GPU summed over mp ranks",
                         _whole(t, t.model_fwd_flops, flops_to_string)))
    out += [_line(bwd_label, flops_to_string(bwd)), _line("fwd+bwd flops per GPU", flops_to_string(fwd + bwd))]
    if t is None:
        if fwd_s:
            out += [_line("fwd latency", duration_to_string(fwd_s)),
                    _line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", _rate(fwd, fwd_s))]
        return out
    out += [_line("fwd+bwd flops of model = summed over mp ranks", _whole(t, t.model_flops, flops_to_string)),
            _line("fwd latency", duration_to_string(t.fwd_s)),
            _line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency", _rate(fwd, t.fwd_s)),
            _line("bwd latency", duration_to_string(t.bwd_s)),
            _line("bwd FLOPS per GPU = bwd flops per GPU / bwd latency", _rate(bwd, t.bwd_s)),
            _line("fwd+bwd FLOPS per GPU = fwd+bwd flops per GPU / (fwd+bwd latency)",
                  _rate(fwd + bwd, t.fwd_s + t.bwd_s)),
            _line("allreduce latency", duration_to_string(t.allreduce_s)),
            _line("step latency", duration_to_string(t.step_s)),
            _line("iter latency", duration_to_string(t.iter_s)),
            _line("FLOPS per GPU = fwd+bwd flops per GPU / iter latency", _rate(fwd + bwd, t.iter_s)),
            _line("MFU", t.mfu),
            _line("samples/second", f"{t.samples * t.dp_size / t.iter_s:.2f}" if t.iter_s else "n/a")]
    if t.tokens_per_s is not None:
        out.append(_line("tokens/second", f"{t.tokens_per_s:.1f}"))
    return out


def _whole(t: StepTiming, value: float, fmt: Callable[[float], str]) -> str:
    return fmt(value) if t.complete else f"{fmt(value)} (incomplete: a model-parallel rank could not count)"


def aggregated_lines(p: Profile, module_depth: int = -1, top_modules: int = 1) -> list[str]:
    """Per depth, the module types with the most params, fwd MACs and fwd latency."""
    by_depth: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))
    for r in p.rows:
        if module_depth < 0 or r.depth <= module_depth:
            agg = by_depth[r.depth][r.type_name]
            agg[0] += r.params
            agg[1] += r.fwd_flops / 2
            agg[2] += r.fwd_duration
    out = [f"{' Aggregated Profile per GPU ':-^78}",
           f"Top {top_modules} module type(s) by params, fwd MACs and fwd latency at each depth:"]
    for depth in sorted(by_depth):
        types = by_depth[depth]
        out += [f"depth {depth}:", f"    params      - {_top(types, 0, top_modules, params_to_string)}",
                f"    MACs        - {_top(types, 1, top_modules, macs_to_string)}",
                f"    fwd latency - {_top(types, 2, top_modules, duration_to_string)}"]
    return out


def _top(types: dict[str, list[float]], i: int, n: int, fmt: Callable[[float], str]) -> dict[str, str]:
    best = sorted(types.items(), key=lambda kv: -kv[1][i])[:n]
    return {name: fmt(v[i]) for name, v in best}


def detailed_lines(p: Profile, module_depth: int = -1) -> list[str]:
    """The module tree, one line per module: params, fwd MACs, fwd and bwd flops, latency, FLOPS."""
    total_params, total_fwd = max(p.params, 1), max(p.fwd_flops, 1)
    root_s = max(p.rows[0].fwd_duration, 1e-12) if p.rows else 1.0
    out = [f"{' Detailed Profile per GPU ':-^78}",
           "Each module: params (% of model), fwd MACs (% of model fwd), fwd flops, bwd flops, fwd latency "
           "(% of the model's), fwd FLOPS. A parent's counts include its children's; what runs in a parent "
           "outside its children (a functional loss, say) makes up the difference."]
    for r in p.rows:
        if module_depth >= 0 and r.depth > module_depth:
            continue
        label = r.name if r.depth == 0 else f"({r.name.rsplit('.', 1)[-1]}): {r.type_name}"
        out.append(f"{'  ' * r.depth}{label}: {params_to_string(r.params)} ({100 * r.params / total_params:.2f}%), "
                   f"{macs_to_string(r.fwd_flops / 2)} ({100 * r.fwd_flops / total_fwd:.2f}%), "
                   f"fwd {flops_to_string(r.fwd_flops)}, bwd {flops_to_string(r.bwd_flops)}, "
                   f"{duration_to_string(r.fwd_duration)} ({100 * r.fwd_duration / root_s:.2f}%), "
                   f"{_rate(r.fwd_flops, r.fwd_duration)}")
    if p.outside_fwd or p.outside_bwd:
        out.append(f"(outside the model's modules): fwd {flops_to_string(p.outside_fwd)}, "
                   f"bwd {flops_to_string(p.outside_bwd)}")
    out.append("Operators: " + ", ".join(f"{op} {flops_to_string(f)}" for op, f in p.ops))
    return out
