"""Cache-sized batches of views: coverage, alignment, write-through; big tensors through Lion/Lamb/Adam."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels.chunks import CHUNK_NUMEL, chunked, cuts, spans
from dslaunch.runtime.optim.registry import build_optimizer, validate_optimizer
from dslaunch.runtime.zero.partition import FlatLayout


def _build(opt_type, params, groups, **kwargs):
    """The engine's path: the section validated once (as when the config is parsed), then built."""
    return build_optimizer(validate_optimizer(opt_type, params), groups, **kwargs)


pytestmark = pytest.mark.timeout(60)


def test_batches_cover_every_element_once_aligned_and_write_through() -> None:
    a = [torch.zeros(10), torch.zeros(3, 4), torch.zeros(1), torch.zeros(25)]
    b = [torch.arange(t.numel(), dtype=torch.float32).view_as(t) for t in a]
    sizes = []
    for xs, ys in chunked((a, b), chunk_numel=8):
        assert [x.shape for x in xs] == [y.shape for y in ys]
        sizes.append(sum(x.numel() for x in xs))
        torch._foreach_add_(xs, ys)
        torch._foreach_add_(xs, 1.0)
    assert sum(sizes) == 48 and all(s >= 8 for s in sizes[:-1]) and max(sizes) < 16
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y + 1)


def test_non_contiguous_tensors_are_taken_whole() -> None:
    t = torch.zeros(6, 4).t()  # non-contiguous
    (views,) = next(chunked(([t],), chunk_numel=4))
    views[0].add_(2.0)
    assert bool((t == 2).all())


@pytest.mark.parametrize("name, cfg", [("Lion", {"lr": 0.01, "weight_decay": 0.1}),
                                       ("Lamb", {"lr": 0.01, "weight_decay": 0.1}),
                                       ("Adam", {"lr": 0.01, "bias_correction": False, "weight_decay": 0.1})])
def test_tensors_larger_than_a_chunk_match_the_small_chunk_free_update(name: str, cfg: dict) -> None:
    # The same update computed one whole tensor at a time (chunk >= tensor) and in pieces.
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(CHUNK_NUMEL + 12345, generator=gen)
    grads = [torch.randn(big.shape, generator=gen) for _ in range(3)]
    whole = big.clone().requires_grad_()
    pieces = big.clone().requires_grad_()
    opt_whole = _build(name, cfg, [whole])
    opt_whole.chunk_numel = 1 << 30  # one chunk covers the whole tensor
    opt_pieces = _build(name, cfg, [pieces])
    assert opt_pieces.chunk_numel == CHUNK_NUMEL < big.numel()  # split into pieces
    for g in grads:
        whole.grad, pieces.grad = g.clone(), g.clone()
        opt_whole.step()
        opt_pieces.step()
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["Lion", "Lamb", "Adam"])
def test_amp_protocol_grad_scale_and_found_inf(name: str) -> None:
    cfg = {"lr": 0.01, "weight_decay": 0.1, **({"bias_correction": False} if name == "Adam" else {})}
    gen = torch.Generator().manual_seed(1)
    start = torch.randn(1000, generator=gen)
    grad = torch.randn(1000, generator=gen)
    plain, scaled = start.clone().requires_grad_(), start.clone().requires_grad_()
    opt_plain, opt_scaled = _build(name, cfg, [plain]), _build(name, cfg, [scaled])
    assert opt_scaled._step_supports_amp_scaling
    plain.grad, scaled.grad = grad.clone(), grad * 1024.0
    opt_plain.step()
    opt_scaled.grad_scale = torch.tensor(1024.0)
    opt_scaled.step()
    torch.testing.assert_close(scaled, plain)
    torch.testing.assert_close(scaled.grad, grad * 1024.0)  # gradients are left as they were
    opt_scaled.found_inf = torch.tensor(1.0)
    before = scaled.detach().clone()
    opt_scaled.step()
    assert torch.equal(scaled.detach(), before)  # skipped


def test_chunked_rows_names_the_source_tensor_of_every_view() -> None:
    from dslaunch.kernels.chunks import chunked_rows

    tensors = [torch.full((10,), 0.0), torch.full((3,), 1.0), torch.full((20,), 2.0)]
    seen = []
    for (views,), rows in chunked_rows((tensors,), chunk_numel=8):
        assert len(views) == len(rows)
        for view, row in zip(views, rows, strict=True):
            assert bool((view == float(row)).all())
            seen.append((row, view.numel()))
    assert [sum(n for r, n in seen if r == row) for row in range(3)] == [10, 3, 20]


def test_spans_start_at_multiples_and_cuts_meet_every_row_once() -> None:
    assert list(spans(20, 8)) == [(0, 8), (8, 16), (16, 20)]
    bounds = FlatLayout(((0, 5), (1, 0), (2, 7), (3, 8)), 4).bounds  # rows 0..3, row 1 empty
    assert bounds == [0, 5, 5, 12, 20]
    met = [(a, cuts(bounds, a, b)) for a, b in spans(20, 8)]
    assert met == [(0, [(0, 0, 5), (2, 5, 8)]), (8, [(2, 0, 4), (3, 4, 8)]), (16, [(3, 0, 4)])]
