"""``eval_batch`` (InferenceSchedule) on 2 stages x 2 replicas against the model in one process."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(120)

GAS = 3


def _model() -> torch.nn.Sequential:
    mods = []
    for idx, spec in enumerate(helpers.layers()):
        torch.manual_seed(helpers.BASE_SEED + idx)
        mods.append(spec.build())
    return torch.nn.Sequential(*mods)


def _eval(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=helpers.BASE_SEED)
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(GAS, 0.1))
    replica = engine.grid.get_data_parallel_rank()

    def data(micro: int = GAS):
        return iter(helpers.micro_batches(0, micro * 2)[replica * micro:(replica + 1) * micro])

    loss, logits = engine.eval_batch(data(), return_logits=True)
    per = engine.eval_batch(data(), reduce_output=None)
    local = engine.eval_batch(data(), bcast_loss=False)
    two = engine.eval_batch(data(2), num_micro_batches=2)
    outputs = engine.eval_batch(data(), compute_loss=False)
    trained = engine.train_batch(data())  # eval left the module trainable and the counters alone
    return {"loss": loss.item(), "logits": logits.tolist() if logits is not None else None,
            "per": [p.item() for p in per] if per is not None else None,
            "local": local.item() if local is not None else None, "two": two.item(),
            "outputs": outputs.tolist(), "trained": trained.item(), "steps": engine.global_steps,
            "training": module.training}


def test_eval_batch_matches_one_process() -> None:
    model = _model()
    with torch.no_grad():
        def losses(micro: int) -> list[float]:
            return [helpers.loss_fn(model(x), y).item() for x, y in helpers.micro_batches(0, micro * 2)]

        full, two = losses(GAS), losses(2)
        outs = [model(x) for x, _ in helpers.micro_batches(0, GAS * 2)]
    got = run_world(_eval, 4)
    for rank, r in enumerate(got):
        stage, replica = divmod(rank, 2)
        assert r["loss"] == pytest.approx(sum(full) / len(full), abs=1e-6)  # micro batches and replicas
        assert r["two"] == pytest.approx(sum(two) / len(two), abs=1e-6)
        assert r["trained"] == pytest.approx(r["loss"], abs=1e-6) and r["steps"] == 1 and r["training"]
        want_outputs = torch.stack(outs).mean(0)  # compute_loss=False: the outputs, averaged
        torch.testing.assert_close(torch.tensor(r["outputs"]), want_outputs, rtol=0, atol=1e-6)
        mine = full[replica * GAS:(replica + 1) * GAS]
        if stage == 1:
            assert r["per"] == pytest.approx(mine, abs=1e-6)
            assert r["local"] == pytest.approx(sum(full) / len(full), abs=1e-6)
            want_logits = torch.cat(outs[replica * GAS:(replica + 1) * GAS])
            torch.testing.assert_close(torch.tensor(r["logits"]), want_logits, rtol=0, atol=1e-6)
        else:
            assert r["per"] is None and r["local"] is None and r["logits"] is None


def _eval_interleaved(rank: int, world: int) -> float:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=helpers.BASE_SEED, virtual_stages=2)
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(2, 0.1, pipeline={"schedule": "interleaved"}))
    return engine.eval_batch(iter(helpers.micro_batches(0, 2))).item()


def test_eval_batch_goes_round_the_chunks() -> None:
    model = _model()
    with torch.no_grad():
        want = sum(helpers.loss_fn(model(x), y).item() for x, y in helpers.micro_batches(0, 2)) / 2
    assert run_world(_eval_interleaved, 2) == pytest.approx([want, want], abs=1e-6)
