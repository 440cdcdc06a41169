"""``train_batch`` on real gloo ranks against the same model trained in one process: 2 stages, 2
stages x 2 replicas, 4 stages; fp32 losses within 1e-6 per step over 20 steps, weights within 2e-5."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(180)

STEPS, LR = 20, 0.1


def _train(rank: int, world: int, stages: int, gas: int, zero: int, extra: dict | None = None,
           virtual: int = 1, blocks: int = 2) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(blocks), num_stages=stages, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=helpers.BASE_SEED, partition_method="type:linear" if blocks > 2 else "parameters",
                            virtual_stages=virtual)
    dp = world // stages
    cfg = helpers.config(gas, LR, **{"zero_optimization": {"stage": zero}, **(extra or {})})
    engine, *_ = dslaunch.initialize(model=module, config=cfg)
    data = helpers.replica_iter(STEPS, gas, dp, engine.grid.get_data_parallel_rank())
    losses = [engine.train_batch(data).item() for _ in range(STEPS)]
    layers: dict[int, list] = {}
    for name, p in engine.module_state_dict().items():  # (waits for the last step's publish)
        layers.setdefault(int(name.split(".")[0]), []).append(p.float().tolist())
    return {"losses": losses, "layers": layers, "stage": engine.stage_id, "steps": engine.global_steps,
            "micro": engine.micro_steps, "type": type(engine).__name__, "scale": engine.loss_scale(),
            "norm": engine.get_global_grad_norm()}


def _check(got: list[dict], gas: int, dp: int, clip: float = 0.0, blocks: int = 2) -> None:
    helpers.check_against_one_process(got, "PipelineEngine", STEPS, gas, dp, LR, clip, blocks)


@pytest.mark.parametrize("stages, world, gas", [(2, 2, 4), (2, 4, 3), (4, 4, 5)])
def test_train_batch_matches_one_process(stages: int, world: int, gas: int) -> None:
    _check(run_world(_train, world, stages, gas, 0, timeout=150), gas, world // stages)


def test_zero1_on_the_data_axis_matches_one_process() -> None:
    _check(run_world(_train, 4, 2, 3, 1, timeout=150), 3, 2)


@pytest.mark.parametrize("zero, extra", [
    (2, {}),  # gradients reduced into their shard at each micro batch's backward
    (2, {"zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 50}}),
    (1, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}),
    (0, {"pipeline": {"activation_checkpoint_interval": 1}}),
    (0, {"pipeline": {"activation_checkpoint_interval": 1, "use_reentrant": False}}),
    (1, {"gradient_clipping": 0.5}),
])
def test_composes_with_zero2_offload_checkpointing_and_clipping(zero: int, extra: dict) -> None:
    got = run_world(_train, 4, 2, 2, zero, extra, timeout=150)
    _check(got, 2, 2, clip=extra.get("gradient_clipping", 0.0))
    if "gradient_clipping" in extra:
        assert len({r["norm"] for r in got}) == 1 and got[0]["norm"] > 0.5  # the whole model's norm, clipped


@pytest.mark.parametrize("stages, world, gas, zero, virtual", [(2, 2, 4, 0, 2), (4, 4, 8, 0, 2), (2, 4, 2, 1, 2),
                                                               (2, 2, 4, 0, 4)])
def test_interleaved_schedule_matches_one_process(stages: int, world: int, gas: int, zero: int, virtual: int) -> None:
    """``virtual`` chunks per rank; 8 parts (4 stages x 2, 2 x 4): 5 middle blocks, one Linear per part
    (the bubble at 4 chunks is 1/4 of 1F1B's: scripts/bench/pipeline_bench.py)."""
    parts = stages * virtual
    extra, blocks = {"pipeline": {"schedule": "interleaved"}}, parts - 3 if parts > 4 else 2
    got = run_world(_train, world, stages, gas, zero, extra, virtual, blocks, timeout=150)
    _check(got, gas, world // stages, blocks=blocks)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_16bit_training_follows_one_process_loosely(precision: str) -> None:
    extra = {precision: {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}}
    got = run_world(_train, 2, 2, 2, 1, extra, timeout=150)
    want, _ = helpers.reference(STEPS, 2, 1, LR)
    for r in got:
        assert r["losses"] == pytest.approx(want, rel=3e-2)  # 16-bit activations and weights
        assert r["scale"] == got[0]["scale"]


def _events_and_refusals(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.errors import ConfigError, UsageError
    from dslaunch.pipe import PipelineModule
    from dslaunch.runtime.events import Observer

    class Count(Observer):
        def __init__(self) -> None:
            self.phases: dict[str, int] = {}
            self.records: list = []

        def phase_begin(self, name: str) -> None:
            self.phases[name] = self.phases.get(name, 0) + 1

        def on_step(self, record) -> None:
            self.records.append((record.step, record.micro_steps, round(record.loss_value(), 6)))

    dslaunch.init_distributed(verbose=False)

    def module() -> PipelineModule:
        return PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn)

    errors = []
    for cfg, kwargs in ((helpers.config(2, LR, zero_optimization={"stage": 3}), {}),
                        (helpers.config(2, LR, pipeline={"stages": 4}), {}),
                        (helpers.config(2, LR, pipeline={"schedule": "1F1B"}), {}),
                        (helpers.config(2, LR), {"mpu": object()})):
        try:
            dslaunch.initialize(model=module(), config=cfg, **kwargs)
        except ConfigError as err:
            errors.append(str(err))
    engine, *_ = dslaunch.initialize(model=module(), config=helpers.config(2, LR, pipeline={"stages": 2}))
    for call in (lambda: engine(torch.ones(1)), lambda: engine.backward(None), engine.step):
        try:
            call()
        except UsageError as err:
            errors.append(str(err))
    with torch.no_grad():
        try:
            engine.train_batch(helpers.replica_iter(1, 2, 1, 0))
        except UsageError as err:
            errors.append(str(err))
    count = engine.events.add(Count())
    data = helpers.replica_iter(3, 2, 1, 0)
    losses = [round(engine.train_batch(data).item(), 6) for _ in range(3)]
    return {"errors": errors, "phases": count.phases, "records": count.records, "losses": losses}


def test_events_per_micro_batch_one_record_per_batch_and_refusals() -> None:
    got = run_world(_events_and_refusals, 2)
    for r in got:
        assert r["phases"] == {"forward": 6, "backward": 6, "allreduce": 6, "step": 3}  # as DeepSpeedEngine
        assert r["records"] == [(k + 1, 2 * k + 1, r["losses"][k]) for k in range(3)]
    errors = got[0]["errors"]
    assert errors[0] == ("'zero_optimization.stage': ZeRO stage 3 cannot be combined with pipeline parallelism "
                         "(a PipelineModule); use zero_optimization.stage 0, 1 or 2")
    assert errors[1] == "'pipeline.stages': 4 differs from the PipelineModule's 2 stages; set it to 2 or \"auto\""
    assert errors[2].startswith("'pipeline.schedule': must be one of 1f1b, interleaved, got '1F1B'")
    assert errors[3].startswith("initialize(mpu=...) with a PipelineModule: the module's own grid is the mpu")
    only = "is not available with pipeline parallelism: use engine.train_batch() (and eval_batch())"
    assert errors[4:7] == [f"engine.{m}() {only}" for m in ("forward", "backward", "step")]
    assert errors[7].startswith("train_batch() was called under torch.no_grad()")
    assert len(errors) == 8 and not any("\n" in e for e in errors)


def _virtual_refusals(rank: int, world: int) -> list[str]:
    import dslaunch
    from dslaunch.errors import ConfigError
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)

    def build(stages: int, gas: int, schedule: str) -> None:
        module = PipelineModule(helpers.layers(), num_stages=stages, loss_fn=helpers.loss_fn, virtual_stages=2)
        dslaunch.initialize(model=module, config=helpers.config(gas, LR, pipeline={"schedule": schedule}))

    cases = ((2, 4, "1f1b"), (2, 3, "interleaved"), (1, 2, "interleaved"))
    return helpers.error_lines([lambda case=case: build(*case) for case in cases], ConfigError)


def test_virtual_stages_need_the_interleaved_schedule_and_whole_rounds() -> None:
    msgs = run_world(_virtual_refusals, 2)[0]
    assert msgs == [
        "'pipeline.schedule': \"1f1b\" runs one part per stage, but the PipelineModule has virtual_stages=2; use "
        "\"interleaved\" (or virtual_stages=1)",
        "'gradient_accumulation_steps': 3 micro batches: the interleaved schedule needs a multiple of the 2 "
        "pipeline stages",
        "'pipeline.schedule': virtual stages need at least 2 pipeline stages (a single stage has nothing to "
        "interleave with); use \"1f1b\" and virtual_stages=1"]


def _raise_mid_batch(rank: int, world: int) -> list:
    """Batch 2's loss raises on its first micro batch (last stage); the script catches every error
    and calls ``train_batch`` again, then ``eval_batch``."""
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    calls = []

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        if len(calls) == 4:  # 3 micro batches a batch
            raise ValueError("bad label")
        return helpers.loss_fn(out, y)

    module = PipelineModule(helpers.layers(), num_stages=world, loss_fn=loss, seed_layers=True,
                            base_seed=helpers.BASE_SEED)
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(3, LR))
    data = helpers.replica_iter(3, 3, 1, 0)
    out: list = [engine.train_batch(data).item()]
    for call in (lambda: engine.train_batch(data),) * 2 + (lambda: engine.eval_batch(data),):
        try:
            out.append(call().item())
        except Exception as err:  # noqa: BLE001 - what the script sees
            out.append(f"{type(err).__name__}: {err}")
    return out


@pytest.mark.timeout(60)
def test_a_batch_that_raised_mid_schedule_stops_every_stage_and_the_next_with_one_line() -> None:
    """3 stages; the last one's loss raises in batch 2. Instead of its messages it sends stops, so the
    stages waiting for them raise one line naming the failure and pass it on (before: they waited
    until the failed process exited). The batch's receives stay posted (a message of it would land
    in the next batch's place), so the next ``train_batch``/``eval_batch`` is refused on every stage
    with one line (before: the last stage's next batch waited forever)."""
    got = run_world(_raise_mid_batch, 3, timeout=40)
    want = helpers.reference(1, 3, 1, LR)[0][0]
    cause = "stage 2 in the forward pass of micro-batch 0: ValueError: bad label"
    stopped = f"PipelineStageError: the pipeline batch stopped: {cause}"
    assert [failed for _, failed, _, _ in got] == [stopped, stopped, "ValueError: bad label"]
    for first, _, refused, eval_refused in got:
        assert first == pytest.approx(want, rel=0, abs=1e-6)
        assert refused == (f"UsageError: train_batch() cannot run: an earlier batch failed ({cause}) and its "
                           "messages between the stages are half exchanged; restart the job (or resume "
                           "from the last checkpoint)")
        assert eval_refused == refused.replace("train_batch()", "eval_batch()")


def _printed(rank: int, world: int, steps: int, every: int) -> dict:
    import contextlib
    import io

    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=helpers.BASE_SEED)
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(2, LR, steps_per_print=every))
    data = helpers.replica_iter(steps, 2, world // 2, engine.grid.get_data_parallel_rank())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        losses = [engine.train_batch(data).item() for _ in range(steps)]
    return {"lines": [line for line in out.getvalue().splitlines() if line.startswith("steps: ")],
            "losses": losses, "batch": engine.train_batch_size()}


def test_rank_0_prints_deepspeeds_per_step_line_with_the_replicas_mean_loss() -> None:
    import re

    got = run_world(_printed, 4, 5, 2, timeout=150)  # 2 stages x 2 replicas, 2 micro batches each
    want, _ = helpers.reference(5, 2, 2, LR)  # the mean over the step's 4 micro batches, in one process
    assert all(not r["lines"] for r in got[1:])  # DeepSpeed's: global rank 0 only
    lines = got[0]["lines"]
    assert len(lines) == 2  # at steps 2 and 4
    for line, step in zip(lines, (2, 4), strict=True):
        m = re.fullmatch(r"steps: (\d+) loss: (\d+\.\d{4}) iter time \(s\): (\d+\.\d{3}) samples/sec: (\d+\.\d{3})",
                         line)
        assert m, line
        assert int(m[1]) == step and m[2] == f"{want[step - 1]:.4f}" == f"{got[0]['losses'][step - 1]:.4f}"
        iter_s, rate = float(m[3]), float(m[4])  # the time printed to the ms: the rate within its rounding
        assert iter_s > 0 and got[0]["batch"] / (iter_s + 5e-4) <= rate <= got[0]["batch"] / (iter_s - 5e-4)
    assert got[0]["batch"] == 8  # micro batch 2 x 2 micro batches x 2 replicas


def _ramped(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn, seed_layers=True,
                            base_seed=helpers.BASE_SEED)
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(2, LR))
    data = iter(helpers.micro_batches(0, 2 + 4))
    engine.train_batch(data)
    engine.set_train_batch_size(helpers.MICRO * 4)  # Megatron-DeepSpeed's ramp-up: 2 -> 4 micro batches
    engine.train_batch(data)
    return {"left": len(list(data)), "samples": engine.global_samples, "micro_batches": engine.micro_batches}


def test_set_train_batch_size_gives_train_batch_more_micro_batches() -> None:
    for out in run_world(_ramped, 2, timeout=150):
        assert out == {"left": 0, "samples": 2 * 2 + 2 * 4, "micro_batches": 4}
