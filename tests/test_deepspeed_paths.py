"""DeepSpeed's import paths that its own unit tests (and scripts) read, answered by dslaunch
(``scripts/conformance`` runs DeepSpeed's tests; these guard the same behaviour without them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.distributed import run_world


def test_git_version_info_and_op_table() -> None:
    import dslaunch
    from dslaunch import git_version_info, ops
    from dslaunch.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, FusedLambBuilder, QuantizerBuilder

    assert git_version_info.version == "0.19.8"
    assert git_version_info.torch_info["version"] == ".".join(torch.__version__.split(".")[:2])
    assert (dslaunch.__git_hash__, dslaunch.__git_branch__) == ("unknown", "unknown")
    table = ops.__compatible_ops__
    assert table[FusedAdamBuilder.NAME] and table[CPUAdamBuilder.NAME]
    # an op dslaunch lacks is DeepSpeed's "not implemented" builder: importable, not compatible
    assert FusedLambBuilder.NAME == QuantizerBuilder.NAME == "deepspeed_not_implemented"
    assert not table[FusedLambBuilder.NAME] and not QuantizerBuilder().is_compatible()
    with pytest.raises(RuntimeError, match="no JIT-built DeepSpeed ops"):
        FusedLambBuilder().load()


def test_parse_range_list_follows_deepspeed() -> None:
    from dslaunch.utils.numa import parse_range_list

    assert parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "a"):
        with pytest.raises(ValueError):
            parse_range_list(bad)


def test_required_torch_version() -> None:
    from dslaunch.utils.torch import required_torch_version

    assert required_torch_version(min_version=1.13) and required_torch_version(min_version="2.0", max_version=99)
    assert not required_torch_version(min_version="99.1") and not required_torch_version(max_version="1.0")
    with pytest.raises(ValueError):
        required_torch_version()


def test_trim_mean_keeps_its_argument() -> None:
    from dslaunch.utils.timer import trim_mean

    data = [3.0, 1.0, 2.0, 100.0, 2.0]
    assert trim_mean(data, 0.2) == pytest.approx(7 / 3)
    assert data == [3.0, 1.0, 2.0, 100.0, 2.0]


def test_moe_paths_are_deepspeeds() -> None:
    from dslaunch.moe.experts import Experts
    from dslaunch.moe.layer import MoE
    from dslaunch.moe.sharded_moe import MOELayer, TopKGate

    layer = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2)
    assert isinstance(layer.deepspeed_moe, MOELayer) and isinstance(layer.deepspeed_moe.gate, TopKGate)
    assert isinstance(layer.deepspeed_moe.experts, Experts)
    out, l_aux, counts = layer(torch.randn(2, 4, 8))
    assert out.shape == (2, 4, 8) and l_aux.ndim == 0 and int(counts.sum()) == 8


def test_multinode_runner_base_quotes_exports_as_deepspeed() -> None:
    from types import SimpleNamespace

    from dslaunch.launcher.multinode_runner import MultiNodeRunner

    class Mine(MultiNodeRunner):
        def backend_exists(self) -> bool:
            return True

        def get_cmd(self, environment, active_resources):
            return ["run", self.user_script, *self.user_arguments]

    runner = Mine(SimpleNamespace(user_args=["--x", "1"], user_script="train.py"), "e30=")
    runner.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    runner.add_export(" PYTHONPATH ", " /usr/lib/python3/site-packages ")
    assert runner.exports == {"SLURM_JOB_CPUS_PER_NODE": '"64(x2)"', "PYTHONPATH": "/usr/lib/python3/site-packages"}
    assert runner.get_cmd({}, {}) == ["run", "train.py", "--x", "1"] and runner.name == "Mine"


def test_schedules_answer_deepspeeds_names() -> None:
    from dslaunch.runtime.pipe.schedule import InferenceSchedule, TrainSchedule

    s = TrainSchedule(micro_batches=4, stages=3, stage_id=1)
    assert (s.stage, s.num_stages, s.num_micro_batches) == (1, 3, 4)
    assert InferenceSchedule(micro_batches=2, stages=1, stage_id=0).num_micro_batches == 2


def test_multiple_all_gather_handles_pass_the_dependency_by_keyword() -> None:
    from dslaunch.runtime.zero.partition_parameters import MultipleAllGatherHandles

    class Handle:
        def wait(self, *, handle_dependency: bool = True) -> None:
            self.seen = handle_dependency

    handles = [Handle(), Handle()]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [False, False]


def test_tag_mismatch_is_also_deepspeeds_assertion_error() -> None:
    import dslaunch
    from dslaunch.errors import CheckpointError, ConfigError, TagMismatchError

    err = TagMismatchError("tags differ")
    assert isinstance(err, CheckpointError) and isinstance(err, AssertionError)
    assert dslaunch.DeepSpeedConfigError is ConfigError


def _reduce_scatter(rank: int, world: int) -> list[list[float]]:
    import torch.distributed as dist

    from dslaunch.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        a = rank * torch.arange(0, 6, dtype=torch.float16)
        b = rank * torch.arange(6, 9, dtype=torch.float16)
        c = torch.zeros(1, dtype=torch.float16)
        return [t.tolist() for t in reduce_scatter_coalesced([a, b, c])]
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_reduce_scatter_coalesced_averages_and_keeps_each_ranks_part() -> None:
    ranks = run_world(_reduce_scatter, 2)
    # mean over ranks 0 and 1 is half of rank 1's tensor; ceil(numel / 2) elements per rank
    assert ranks[0] == [[0.0, 0.5, 1.0], [3.0, 3.5], [0.0]]
    assert ranks[1] == [[1.5, 2.0, 2.5], [4.0], []]


def test_the_deepspeed_command_passes_quoted_user_args(tmp_path) -> None:
    """What DeepSpeed's test_user_args checks, with dslaunch's launcher: the script gets each
    argument as given, quotes and all."""
    import subprocess

    script = tmp_path / "args.py"
    script.write_text("import sys\nprint(repr(sys.argv[1:]))\n")
    prompt = """I'm going to tell them "DeepSpeed is the best\""""
    from dslaunch.utils.ports import free_port

    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.runner", "--num_gpus", "1",
                          "--master_port", str(free_port()), str(script), "--prompt", prompt], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
    assert repr(["--local_rank=0", "--prompt", prompt]) in out.stdout, out.stdout + out.stderr


def test_prime_factors_refuse_what_has_none() -> None:
    from dslaunch.runtime.pipe.topology import _prime_factors

    assert _prime_factors(12) == [2, 2, 3] and _prime_factors(1) == []
    with pytest.raises(ValueError):
        _prime_factors(0)


def test_runtime_utils_seed() -> None:
    # see_memory_usage's report: tests/runtime/test_utils.py
    from dslaunch.runtime.utils import set_random_seed

    set_random_seed(3)
    a = torch.rand(3)
    set_random_seed(3)
    assert torch.equal(a, torch.rand(3))


def test_config_errors_are_value_errors() -> None:
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.config import load_config

    with pytest.raises(ValueError, match="unknown key"):
        load_config({"train_batch_size": 2, "nope": 1}, 1)
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("in_splits, out_splits", [(1, 1), (2, 3), (5, 5)])
def test_tiled_linear_matches_the_layer_it_splits(in_splits: int, out_splits: int) -> None:
    from dslaunch.runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

    torch.manual_seed(0)
    base = torch.nn.Linear(23, 29)
    tiled = TiledLinear(23, 29, in_splits=in_splits, out_splits=out_splits, init_linear=base)
    assert [len(row) for row in tiled.linears] == [in_splits] * out_splits
    assert all((tile.bias is not None) == (i == in_splits - 1) for row in tiled.linears for i, tile in enumerate(row))
    x = torch.randn(4, 23)
    assert torch.allclose(tiled(x), base(x), atol=1e-6)
    out, bias = TiledLinearReturnBias(23, 29, in_splits=in_splits, out_splits=out_splits, init_linear=base)(x)
    assert torch.allclose(out + bias, base(x), atol=1e-6)
    for bad in (0, 24):
        with pytest.raises(RuntimeError, match="in_splits"):
            TiledLinear(23, 29, in_splits=bad)


def test_csv_monitor_names_its_settings_as_deepspeed() -> None:
    from dslaunch.monitor.csv_monitor import csvMonitor
    from dslaunch.runtime.config import DeepSpeedConfig
    from dslaunch.runtime.config.monitors import DeepSpeedMonitorConfig

    cfg = DeepSpeedConfig({"train_batch_size": 2, "csv_monitor": {"enabled": True, "output_path": "out/",
                                                                   "job_name": "j"}})
    monitor = csvMonitor(cfg.monitor_config.csv_monitor)
    assert (monitor.enabled, monitor.output_path, monitor.job_name) == (True, "out/", "j")
    default = csvMonitor(DeepSpeedMonitorConfig().csv_monitor)
    assert (default.output_path, default.job_name) == (DeepSpeedMonitorConfig().csv_monitor.output_path,
                                                       DeepSpeedMonitorConfig().csv_monitor.job_name)


@pytest.mark.timeout(60)
def test_deepspeeds_other_top_level_names() -> None:
    """What DeepSpeed 0.19.8's ``__init__`` imports beside ``initialize``: the same objects as
    their modules' here, still without importing torch for the cheap ones."""
    probe = ("import sys, dslaunch as ds; assert ds.logger is ds.utils.logging.logger; "
             "assert ds.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500 and 'torch' not in sys.modules; "
             "assert ds.dist is ds.comm and ds.PipelineModule is ds.pipe.PipelineModule; "
             "assert ds.log_dist is ds.utils.logging.log_dist and ds.MUON_OPTIMIZER == 'muon'; "
             "assert ds.version == '0.19.8' and ds.git_hash == ds.git_version_info.git_hash; "
             "assert ds.DeepSpeedInferenceConfig is ds.inference.DeepSpeedInferenceConfig")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
