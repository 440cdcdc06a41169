"""AutoTP training (``"tensor_parallel": {"autotp_size": N}``) on 4 gloo ranks, fp32.

The tiny GQA language model (``models.py``) is trained 20 steps with Adam and gradient clipping
at tp 2 x dp 2 and at tp 4 (ZeRO-1 and ZeRO-2), every run on the same global batch per step.
Each step's loss (averaged over the data-parallel ranks) must equal the single-process run's
within 1e-6, and rank 0 must hold at most 1/tp + 10% of the parameter and optimizer-state bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.tensor_parallel.models import VOCAB, TrainableLM, rule_batch

pytestmark = pytest.mark.timeout(240)

STEPS, GLOBAL_BATCH, SEQ = 20, 8, 12


def _config(tp: int, stage: int, dp: int, optimizer: dict | None = None, loss_parallel: bool | str = False,
            rules: dict | None = None) -> dict:
    # no train_batch_size: DeepSpeed's (and dslaunch's) count without an mpu includes the slices;
    # loss_parallel "deepspeed": asked for by DeepSpeed 0.19.8's key
    vocab = {"vocab_parallel_lm_head": True} if loss_parallel == "deepspeed" else {"loss_parallel": loss_parallel}
    return {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
            "optimizer": optimizer or ADAM, "gradient_clipping": 0.5,
            "zero_optimization": {"stage": stage},
            "tensor_parallel": {"autotp_size": tp, **vocab, "partition_config": rules},
            "steps_per_print": 1000}


def _batch(step: int) -> torch.Tensor:
    return rule_batch(step, GLOBAL_BATCH, SEQ)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ExampleMPU:
    """The minimal mpu of DeepSpeedExamples' ``training/tensor_parallel/basic_example``: its
    model-parallel group is the tensor group (tensor fastest), built by the script itself."""

    def __init__(self, rank: int, world: int, tp: int):
        import torch.distributed as dist

        dp = world // tp
        self.tp_rank, self.dp_rank, self.tp_size, self.dp_size = rank % tp, rank // tp, tp, dp
        for ranks in [list(range(d * tp, (d + 1) * tp)) for d in range(dp)]:
            group = dist.new_group(ranks)
            self.tp_group = group if rank in ranks else getattr(self, "tp_group", None)
        for ranks in [[t + d * tp for d in range(dp)] for t in range(tp)]:
            group = dist.new_group(ranks)
            self.dp_group = group if rank in ranks else getattr(self, "dp_group", None)

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_model_parallel_rank(self):
        return self.tp_rank


ADAM = {"type": "Adam", "params": {"lr": 3e-3}}
# Adam's first step moves each weight by lr * sign(gradient) whatever its size above eps: a
# gradient of ~1e-8 that the sharded sums round differently (measured: gradients equal within
# 3e-8) moves differently. The tied model has such elements; it trains with SGD.
SGD = {"type": "SGD", "params": {"lr": 0.3}}


def _train(rank: int, world: int, tp: int, stage: int, tied: bool, entry: str = "config",
           optimizer: dict = ADAM, loss_parallel: bool = False, rules: dict | None = None) -> dict:
    import torch.distributed as dist

    import dslaunch

    torch.manual_seed(0)
    model = TrainableLM(tied=tied)
    whole = _nbytes({id(p): p for p in model.parameters()}.values())
    dp = world // tp
    config = _config(tp, stage, dp, optimizer, loss_parallel, rules)
    if entry == "example_mpu":  # as the example: its own groups, a client optimizer built on the whole model
        dslaunch.init_distributed()
        client = torch.optim.Adam(model.parameters(), lr=config.pop("optimizer")["params"]["lr"])
        engine, optimizer, *_ = dslaunch.initialize(model=model, optimizer=client, config=config,
                                                    mpu=ExampleMPU(rank, world, tp))
    elif entry == "tp_model_init":  # DeepSpeed's older entry: the degree recorded on the model, not in the config
        del config["tensor_parallel"]
        engine, optimizer, *_ = dslaunch.initialize(model=dslaunch.tp_model_init(model, tp, torch.float32),
                                                    config=config)
    else:
        engine, optimizer, *_ = dslaunch.initialize(model=model, config=config)
    data_rank, micro = engine.grid.get_data_parallel_rank(), GLOBAL_BATCH // dp
    assert engine.dp_world_size == dp
    losses = []
    for step in range(STEPS):
        ids = _batch(step)[data_rank * micro:(data_rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= world  # every slice of a replica holds its replica's loss
        losses.append(mean.item())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    with torch.no_grad():  # the widest logits this rank ever holds (loss_parallel: its slice)
        width = engine(input_ids=ids).shape[-1]
    return {"losses": losses, "params": _nbytes({id(p): p for p in engine.module.parameters()}.values()),
            "whole": whole, "state": _nbytes(state), "logits_width": width}


@pytest.fixture(scope="module")
def reference() -> dict:
    return {tied: run_world(_train, 1, 1, 1, tied)[0] for tied in (False, True)}


# Both degrees at both stages; the vocab-parallel loss at tp 2 x dp 2 and at tp 4 (one run each).
@pytest.mark.parametrize(("tp", "stage", "loss_parallel"), [(2, 1, False), (4, 1, True), (2, 2, "deepspeed"),
                                                           (4, 2, False)])
def test_losses_equal_the_unsharded_run(reference: dict, tp: int, stage: int, loss_parallel: bool | str) -> None:
    ref = reference[False]
    got = run_world(_train, 4, tp, stage, False, "config", ADAM, loss_parallel, timeout=200)
    worst = max(abs(a - b) for a, b in zip(got[0]["losses"], ref["losses"], strict=True))
    assert worst <= 1e-6, (worst, got[0]["losses"][:3], ref["losses"][:3])
    assert ref["losses"][-1] < ref["losses"][0] - 0.05  # it trains
    dp = 4 // tp
    bound = 1 / tp + 0.1
    assert got[0]["params"] <= bound * ref["params"], (got[0]["params"], ref["params"])
    # ZeRO splits the optimizer state over the dp data ranks: rank 0 holds its 1/dp of its slice's
    assert got[0]["state"] * dp <= bound * ref["state"], (got[0]["state"], ref["state"])
    # loss_parallel: the logits are never gathered whole (each rank keeps its vocabulary slice)
    assert got[0]["logits_width"] == (VOCAB // tp if loss_parallel else VOCAB)


def test_tied_embedding_and_output_layer() -> None:
    """GPT-2's tie: the lm_head holds the embedding's vocabulary shard (one Parameter), and its
    logits stay split into the vocab-parallel loss."""
    ref = run_world(_train, 1, 1, 1, True, "config", SGD)[0]
    got = run_world(_train, 4, 2, 1, True, "config", SGD, True, timeout=200)
    worst = max(abs(a - b) for a, b in zip(got[0]["losses"], ref["losses"], strict=True))
    assert worst <= 1e-6, worst
    assert got[0]["params"] <= (0.5 + 0.1) * ref["params"]


def test_an_mpu_and_a_client_optimizer_as_deepspeed_examples_pass_them(reference: dict) -> None:
    got = run_world(_train, 4, 2, 2, False, "example_mpu", timeout=200)
    worst = max(abs(a - b) for a, b in zip(got[0]["losses"], reference[False]["losses"], strict=True))
    assert worst <= 1e-6, worst
    assert got[0]["state"] * 2 <= 0.6 * reference[False]["state"]


def test_tp_model_init_records_the_degree_that_initialize_shards_with(reference: dict) -> None:
    got = run_world(_train, 4, 4, 1, False, "tp_model_init", timeout=200)
    worst = max(abs(a - b) for a, b in zip(got[0]["losses"], reference[False]["losses"], strict=True))
    assert worst <= 1e-6, worst
    assert got[0]["params"] <= (0.25 + 0.1) * reference[False]["params"]


# DeepSpeed's partition_config for the model: attention and MLP split by name, the output layer
# column-split with its logits gathered, the rest (embedding, norms) whole.
RULES = {"use_default_specs": False, "layer_specs": [
    {"patterns": [r".*\.attn\.[qkv]\.weight$", r".*\.(gate|up)\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.attn\.o\.weight$", r".*\.down\.weight$"], "partition_type": "row"},
    {"patterns": [r".*\.head\.weight$"], "partition_type": "column", "gather_output": True},
    {"patterns": [r".*"], "partition_type": "skip"}]}


def test_partition_config_rules_train_as_the_unsharded_model(reference: dict) -> None:
    """The hand-written rules in place of the dataflow planner: the same split (heads set to the
    rank's by the row layer's input), the same losses as one process, a 1/tp share of the bytes."""
    got = run_world(_train, 4, 2, 1, False, "config", ADAM, False, RULES, timeout=200)
    worst = max(abs(a - b) for a, b in zip(got[0]["losses"], reference[False]["losses"], strict=True))
    assert worst <= 1e-6, worst
    assert got[0]["params"] <= (0.5 + 0.1) * reference[False]["params"]
    assert got[0]["logits_width"] == VOCAB  # gather_output: every rank holds the whole logits


def _refused(rank: int, world: int) -> list[str]:
    import dslaunch
    from dslaunch.pipe import LayerSpec, PipelineModule

    messages = []
    torch.manual_seed(0)
    config = _config(4, 1, 1)
    try:  # 4 slices of a model with 2 KV heads
        dslaunch.initialize(model=TrainableLM(kv_heads=2), config=config)
    except Exception as err:  # noqa: BLE001 (the message is the assertion)
        messages.append(str(err))
    try:
        model = dslaunch.tp_model_init(TrainableLM(), 2, torch.float32)
        dslaunch.initialize(model=model, config=_config(4, 1, 1))
    except Exception as err:  # noqa: BLE001
        messages.append(str(err))
    try:  # the vocab-parallel loss needs Hugging Face's loss_function hook
        model = TrainableLM()
        del model.loss_function
        dslaunch.initialize(model=model, config=_config(4, 1, 1, loss_parallel=True))
    except Exception as err:  # noqa: BLE001
        messages.append(str(err))
    torch.manual_seed(0)
    engine = dslaunch.initialize(model=TrainableLM(), config=_config(2, 1, 2))[0]
    try:  # each rank its own batch: the slices of a replica disagree
        ids = _batch(rank)[:4]
        engine(input_ids=ids, labels=ids)
    except Exception as err:  # noqa: BLE001
        messages.append(str(err))
    try:
        pipe = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4)], num_stages=1)
        dslaunch.initialize(model=pipe, config=_config(4, 1, world))  # its grid: 4 data ranks
    except Exception as err:  # noqa: BLE001
        messages.append(str(err))
    return messages


def test_what_autotp_training_refuses() -> None:
    messages = run_world(_refused, 4)[0]
    assert messages[0].startswith("'tensor_parallel.autotp_size': 4 is more than the model's 2 key/value heads")
    assert messages[1].startswith("'tensor_parallel.autotp_size': 4 but tp_model_init(tp_size=2) was called")
    assert messages[2].startswith("'tensor_parallel.loss_parallel': true but TrainableLM has no loss_function")
    assert messages[3].startswith("tensor_parallel.autotp_size: the tensor-parallel ranks of one replica got "
                                  "different inputs in their first forward")
    assert messages[4].startswith("'tensor_parallel.autotp_size': AutoTP training with a PipelineModule is not")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hugging_face_llama_and_gpt2(compat_bin, tmp_path) -> None:
    """Tiny Llama (GQA) and GPT-2 (tied, Conv1D, fused qkv) from transformers configs, trained at
    tp 2 x dp 2 and tp 4 (the vocab-parallel loss through the model's own loss_function) in one
    4-rank job, against the same script in one process."""
    from dslaunch.utils.ports import free_port
    from tests.compat.conftest import run_job, tagged

    script = str(Path(__file__).resolve().parent / "scripts" / "hf_train.py")
    alone = run_job([str(compat_bin / "python"), script, str(tmp_path / "alone"), "1"], cwd=tmp_path, timeout=150)
    ref = json.loads(alone.split("RESULTS ", 1)[1].splitlines()[0])
    got = tagged(run_job([str(compat_bin / "dslaunch"), "--num_gpus", "4", "--master_port", str(free_port()),
                          script, str(tmp_path / "sliced"), "2", "4"], cwd=tmp_path, timeout=240), "RESULTS")
    for family in ("llama", "gpt2"):
        want = ref[f"{family}@tp1"]
        assert want["losses"][-1] < want["losses"][0] - 0.05, want["losses"]
        for tp in (2, 4):
            mine = got[f"{family}@tp{tp}"]
            worst = max(abs(a - b) for a, b in zip(mine["losses"], want["losses"], strict=True))
            assert worst <= 1e-6, (family, tp, worst)
            assert mine["bytes"] <= (1 / tp + 0.1) * want["whole"], (family, tp, mine["bytes"], want["whole"])
            assert mine["width"] == (want["width"] // tp if tp == 4 else want["width"])  # tp 4: loss_parallel
            # zero_to_fp32 of the tp tag is the whole model (GPT-2's Conv1D back in its [in, out] layout)
            assert abs(mine["exported"] - mine["next"]) <= 1e-6, (family, tp, mine["exported"], mine["next"])


def _engine_at(tp: int, world: int):
    import dslaunch

    torch.manual_seed(0)
    return dslaunch.initialize(model=TrainableLM(), config=_config(tp, 1, world // tp))[0]


def _steps(engine, first: int, count: int) -> list[float]:
    micro = GLOBAL_BATCH // engine.dp_world_size
    data_rank, out = engine.grid.get_data_parallel_rank(), []
    for step in range(first, first + count):
        ids = _batch(step)[data_rank * micro:(data_rank + 1) * micro]
        loss = engine(input_ids=ids, labels=ids)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        out.append(mean.item() / torch.distributed.get_world_size())  # the replicas' mean
    return out


def _resume(rank: int, world: int, root: str) -> dict:
    """10 steps at tp 2, save, 5 more (the run that never stops). The tag loads at tp 4 (saved
    again at once, then 5 steps) and that tag back at tp 2 (5 steps)."""
    engine = _engine_at(2, world)
    _steps(engine, 0, 10)
    engine.save_checkpoint(root, tag="t10")
    straight = _steps(engine, 10, 5)
    same = _engine_at(2, world)
    same.load_checkpoint(root, tag="t10")
    wider = _engine_at(4, world)
    wider.load_checkpoint(root, tag="t10")
    wider.save_checkpoint(root, tag="t10-tp4")
    back = _engine_at(2, world)
    back.load_checkpoint(root, tag="t10-tp4")
    # the same weights (bit for bit: the round trip below) evaluated at tp 2 and at tp 4
    first = {tp: _no_grad_loss(engine, 10) for tp, engine in ((2, same), (4, wider))}
    return {"straight": straight, "same": _steps(same, 10, 5), "tp4": _steps(wider, 10, 5),
            "back": _steps(back, 10, 5), "first": first}


def _no_grad_loss(engine, step: int) -> float:
    micro = GLOBAL_BATCH // engine.dp_world_size
    data_rank = engine.grid.get_data_parallel_rank()
    ids = _batch(step)[data_rank * micro:(data_rank + 1) * micro]
    with torch.no_grad():
        loss = engine(input_ids=ids, labels=ids).detach().clone()
    torch.distributed.all_reduce(loss)
    return loss.item() / torch.distributed.get_world_size()


def test_a_tag_resumes_at_the_same_tp_and_reshards_to_another(tmp_path) -> None:
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for got in run_world(_resume, 4, str(tmp_path), timeout=240):
        assert got["same"] == got["straight"], got  # bit for bit
        assert got["back"] == got["straight"], got  # 2 -> 4 -> 2: the slices joined and cut exactly
        # Not bit for bit across degrees, by arithmetic alone (the weights and optimizer state are
        # resharded exactly: the round trip above). At a fixed world a new tp is a new dp, so the
        # batch gradient is summed in another order; and at one dp a column layer's input gradient
        # is all-reduced over 4 parts instead of 2 (float32 addition is not associative). Measured:
        # this first loss is equal (the forward rounded alike), the second step's 2.4e-7 apart.
        # (The layout_invariant block makes it bit for bit: test_layout_invariant.py.)
        assert abs(got["first"][4] - got["first"][2]) <= 1e-6, got["first"]
        assert max(abs(a - b) for a, b in zip(got["tp4"], got["straight"], strict=True)) <= 1e-6, got
    # zero_to_fp32 of the tp 2 tag: the whole model, whose loss on the next batch is the run's
    whole = TrainableLM()
    whole.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t10"))
    with torch.no_grad():
        loss = whole(input_ids=_batch(10), labels=_batch(10)).item()
    assert abs(loss - got["straight"][0]) <= 1e-6, (loss, got["straight"][0])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_the_hugging_face_trainer_at_autotp_2(compat_bin, tmp_path, stage: int) -> None:
    """The Trainer (accelerate, "auto" values, tp_model_init from transformers) with
    ``autotp_size: 2`` on 2 ranks trains GPT-2 as the same job on one rank does (dropout off).
    At ZeRO-3 ``save_model`` writes the whole model, not a slice."""
    from safetensors.torch import load_file

    from dslaunch.utils.ports import free_port
    from tests.compat.conftest import run_job, tagged

    script = str(Path(__file__).resolve().parents[2] / "compat" / "scripts" / "trainer_gpt2.py")

    def losses(ranks: int, *opts: str) -> list[float]:
        out = run_job([str(compat_bin / "dslaunch"), "--num_gpus", str(ranks), "--master_port", str(free_port()),
                       script, f"out{ranks}", "6", str(stage), *opts], cwd=tmp_path, timeout=200)
        return tagged(out, "LOSSES")

    alone, sliced = losses(1, "autotp=1", "final=final1"), losses(2, "autotp=2", "final=final2")
    assert alone[-1] < alone[0] - 0.05, alone
    assert max(abs(a - b) for a, b in zip(alone, sliced, strict=True)) <= 1e-6, (alone, sliced)
    if stage == 3:  # measured: within 3.5e-6 (AdamW's steps of gradients equal to rounding)
        whole, joined = (load_file(tmp_path / f"final{n}" / "model.safetensors") for n in (1, 2))
        assert whole.keys() == joined.keys()
        for name, value in whole.items():
            torch.testing.assert_close(joined[name], value, rtol=0, atol=2e-5, msg=name)
