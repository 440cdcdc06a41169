"""Stage 3's trace, prefetch and live-parameter limits (``runtime/zero/prefetch.py``) on 2 gloo ranks.

A stack of 6 linear layers, every parameter partitioned. Probes registered after the engine's
hooks sample, while each layer runs forward and when each layer's gradient arrives, what is whole
or being gathered: prefetch must have the next layers in flight (from the second step: the first
records), ``stage3_max_live_parameters`` must bound the whole elements, and
``stage3_max_reuse_distance`` must keep parameters until backward reuses them. Whatever the
settings, and when the module order changes between steps, training matches on-demand gathering.
"""

from __future__ import annotations

import pytest

from tests.distributed import run_world

WIDTH, LAYERS = 32, 6
LAYER = WIDTH * WIDTH + WIDTH  # elements of one layer


def _engine(zero: dict, checkpointed: bool = False):
    import torch
    from torch.utils.checkpoint import checkpoint

    import dslaunch

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
            self.skip = (5,)  # layers not run (a data-independent branch the test changes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for i, lin in enumerate(self.layers):
                if i in self.skip:
                    continue
                if checkpointed and i in (1, 2):  # recomputed inside backward
                    x = checkpoint(lambda y, lin=lin: torch.tanh(lin(y)), x, use_reentrant=i == 1)
                else:
                    x = torch.tanh(lin(x))
            return x.square().mean()

    cfg = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}
    model = Net()
    engine, *_ = dslaunch.initialize(model=model, config=cfg)
    return engine, model


def _probe(engine, model) -> list[tuple[str, int, list[str], int]]:
    """Samples (phase, layer, status of every layer's weight, whole-or-in-flight elements)."""
    samples: list[tuple[str, int, list[str], int]] = []

    # Held once, outside any forward: reading ``lin.weight`` inside one would gather it (a
    # parameter read outside its module's forward is fetched, as DeepSpeed fetches it).
    weights = [next(lin.parameters()) for lin in model.layers]

    def sample(phase: str, k: int) -> None:
        status = [w.ds_status.name for w in weights]
        samples.append((phase, k, status, engine.zero.fetcher.live.numel()))

    for k, lin in enumerate(model.layers):
        lin.register_forward_pre_hook(lambda m, a, k=k: sample("forward", k))
        lin.weight.register_hook(lambda g, k=k: sample("backward", k))
    return samples


def _train(rank: int, world: int, zero: dict, skips: list[tuple[int, ...]], checkpointed: bool = False) -> dict:
    import torch

    from dslaunch.runtime.zero.partition_parameters import GatheredParameters

    engine, model = _engine(zero, checkpointed)
    samples = _probe(engine, model)
    torch.manual_seed(1)
    per_step, whole_after_forward = [], []
    for skip in skips:
        model.skip = skip
        x = torch.randn(4, WIDTH)[rank * 2:(rank + 1) * 2]
        samples.clear()
        loss = engine(x)
        whole_after_forward.append(sum(p.numel() for p in model.parameters()))
        engine.backward(loss)
        engine.step()
        per_step.append(list(samples))
        with torch.no_grad():  # an evaluation forward between steps: another mode, its own trace
            engine.eval()
            engine(x)
            engine.train()
    with GatheredParameters(list(model.parameters())):
        weights = [p.detach().reshape(-1).tolist() for p in model.parameters()]  # a tensor would not outlive the rank
    return {"samples": per_step, "whole_after_forward": whole_after_forward, "weights": weights,
            "left_whole": sum(p.numel() for p in model.parameters())}


def _ahead(samples: list, phase: str) -> list[str]:
    """The status of the layer that runs next, seen while each layer runs (that phase only)."""
    rows = [(k, status) for ph, k, status, _ in samples if ph == phase]
    return [status[rows[i + 1][0]] for i, (k, status) in enumerate(rows[:-1])]


@pytest.mark.timeout(120)
def test_prefetch_gathers_the_next_layers_while_one_runs() -> None:
    """Bucket of 2 layers, no reuse: step 1 records (nothing ahead), step 2 has the next layer in
    flight or whole in forward and in backward; no more than 2 layers beyond the running one
    (and the one backward just finished) are whole; training equals on-demand gathering."""
    skips = [(5,)] * 3
    prefetch = run_world(_train, 2, {"stage3_prefetch_bucket_size": 2 * LAYER, "stage3_max_reuse_distance": 0},
                         skips)[0]
    on_demand = run_world(_train, 2, {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}, skips)[0]
    first, second = prefetch["samples"][0], prefetch["samples"][1]
    assert set(_ahead(first, "forward")) == {"NOT_AVAILABLE"}
    # layer 0's weight is not used in backward (its input needs no gradient): never prefetched there
    assert "NOT_AVAILABLE" not in _ahead(second, "forward") + _ahead(second, "backward")[:-1]
    assert max(live for *_, live in second) <= (1 + 1 + 2) * LAYER
    assert set(_ahead(on_demand["samples"][1], "forward")) == {"NOT_AVAILABLE"}
    for a, b in zip(prefetch["weights"], on_demand["weights"], strict=True):
        assert a == b
    assert prefetch["left_whole"] == 0


@pytest.mark.timeout(120)
def test_a_changed_module_order_falls_back_and_records_again() -> None:
    """The set of layers run changes between steps (a branch): prefetch of the recorded order would
    gather the wrong layers (they are in flight when the mismatch is seen); the mismatch drops the
    trace, the next step records the new order, the one after replays it; the weights still equal
    on-demand gathering."""
    skips = [(5,), (5,), (1, 5), (1, 5), (1, 5), (5,), (0, 3), (5,)]
    zero = {"stage3_prefetch_bucket_size": 3 * LAYER, "stage3_max_reuse_distance": 2 * LAYER}
    prefetch = run_world(_train, 2, zero, skips)[0]
    on_demand = run_world(_train, 2, {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}, skips)[0]
    assert "NOT_AVAILABLE" not in _ahead(prefetch["samples"][1], "forward")
    assert set(_ahead(prefetch["samples"][3], "forward")) == {"NOT_AVAILABLE"}  # recording (1, 5)
    assert "NOT_AVAILABLE" not in _ahead(prefetch["samples"][4], "forward")  # replaying it
    for a, b in zip(prefetch["weights"], on_demand["weights"], strict=True):
        assert a == b
    assert prefetch["left_whole"] == 0


@pytest.mark.timeout(120)
def test_max_live_parameters_bounds_the_whole_elements() -> None:
    """Prefetch and reuse unbounded: with the defaults every layer ends up whole at once; with
    stage3_max_live_parameters at 2.5 layers no sample sees more than that whole or in flight."""
    skips = [(5,)] * 3
    free = run_world(_train, 2, {"stage3_prefetch_bucket_size": 10**9}, skips)[0]
    limit = 5 * LAYER // 2
    bounded = run_world(_train, 2, {"stage3_prefetch_bucket_size": 10**9,
                                    "stage3_max_live_parameters": limit}, skips)[0]
    assert max(live for step in free["samples"] for *_, live in step) >= 5 * LAYER
    assert max(live for step in bounded["samples"] for *_, live in step) <= limit
    assert max(live for step in bounded["samples"] for *_, live in step) >= 2 * LAYER  # prefetch still works
    for a, b in zip(free["weights"], bounded["weights"], strict=True):
        assert a == b


@pytest.mark.timeout(120)
def test_max_reuse_distance_keeps_parameters_backward_uses_again() -> None:
    """No prefetch. Distance 1e9 (the default): from step 2 every weight backward uses (layers 1-4:
    layer 0's input needs no gradient, biases are not needed) stays whole from its forward to its
    backward; distance 0: none is whole after forward."""
    skips = [(5,)] * 2
    kept = run_world(_train, 2, {"stage3_prefetch_bucket_size": 0}, skips)[0]
    released = run_world(_train, 2, {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}, skips)[0]
    assert kept["whole_after_forward"] == [0, 4 * WIDTH * WIDTH]
    assert released["whole_after_forward"] == [0, 0]
    assert kept["left_whole"] == released["left_whole"] == 0


@pytest.mark.timeout(120)
def test_activation_checkpointing_replays_with_prefetch_and_a_live_bound() -> None:
    """Layers 1 and 2 under torch.utils.checkpoint (reentrant and not): their forwards run again
    inside backward, as trace events too; with prefetch, reuse and a live bound of 2 layers the
    weights equal on-demand gathering after 3 steps and nothing is left whole."""
    skips = [(5,)] * 3
    zero = {"stage3_prefetch_bucket_size": LAYER, "stage3_max_live_parameters": 2 * LAYER}
    prefetch = run_world(_train, 2, zero, skips, True)[0]
    on_demand = run_world(_train, 2, {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0},
                          skips, True)[0]
    assert "INFLIGHT" in _ahead(prefetch["samples"][2], "forward")  # (recomputes included)
    assert max(live for step in prefetch["samples"] for *_, live in step) <= 2 * LAYER
    for a, b in zip(prefetch["weights"], on_demand["weights"], strict=True):
        assert a == b
    assert prefetch["left_whole"] == 0
