"""ds_config validation: every mistake is a ConfigError that names the key and the fix."""

from __future__ import annotations

import json

import pytest

from dslaunch.errors import BucketAlignmentError, ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.sections import REMOVED_FROM_DEEPSPEED


def _error(raw: dict, world: int = 2) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(raw, world)
    return str(info.value)


def test_typo_suggests_the_key() -> None:
    msg = _error({"train_batch_size": 8, "gradient_clipings": 1.0})
    assert "'gradient_clipings'" in msg and "did you mean 'gradient_clipping'" in msg


def test_nested_typo_names_the_path() -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": True}})
    assert "'zero_optimization.overlap_com'" in msg and "did you mean 'overlap_comm'" in msg


def test_wrong_type_names_the_path() -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": "2"}})
    assert "'zero_optimization.stage'" in msg and "integer" in msg
    assert "'fp16.enabled'" in _error({"train_batch_size": 8, "fp16": {"enabled": "yes"}})


def test_out_of_range_names_the_path() -> None:
    assert "'gradient_clipping'" in _error({"train_batch_size": 8, "gradient_clipping": -1})
    dynamic = {"enabled": True, "loss_scale": 0}
    assert "'fp16.loss_scale_window'" in _error({"train_batch_size": 8, "fp16": {**dynamic, "loss_scale_window": 0}})
    assert "'fp16.min_loss_scale'" in _error({"train_batch_size": 8, "fp16": {**dynamic, "min_loss_scale": 0}})


@pytest.mark.parametrize("fp16", [{"enabled": True, "loss_scale": 128}, {"enabled": False}])
def test_dynamic_scaling_settings_are_unchecked_where_unused(fp16: dict) -> None:
    # DeepSpeed keeps them there (a static-scale config may carry 0): refusing would break its configs
    cfg = load_config({"train_batch_size": 8, "fp16": {**fp16, "loss_scale_window": 0, "min_loss_scale": -1}}, 1)
    assert (cfg.fp16.loss_scale_window, cfg.fp16.min_loss_scale) == (0, -1)


@pytest.mark.parametrize("raw, world, want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4,
     (32, 4, 2)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (32, 4, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
    ({"train_batch_size": 32}, 4, (32, 8, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, 2, (6, 3, 1)),
])
def test_batch_triad_derives_the_missing_value(raw: dict, world: int, want: tuple) -> None:
    cfg = load_config(raw, world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == want


def test_batch_triad_inconsistency_shows_the_arithmetic() -> None:
    msg = _error({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                  "gradient_accumulation_steps": 2}, world=2)
    assert "16 != " in msg and "3 * 2 * 2 = 12" in msg
    msg = _error({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}, world=2)
    assert "4 * 2 = 8" in msg and "not divisible" in msg
    assert "train_micro_batch_size_per_gpu" in _error({"gradient_accumulation_steps": 2})


def test_auto_without_a_default_says_what_to_put_there() -> None:
    msg = _error({"train_batch_size": "auto"})
    assert "Hugging Face" in msg and "an integer" in msg and "'train_batch_size'" in msg
    msg = _error({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})
    assert "'optimizer.params.lr'" in msg and "auto" in msg


# What TRL's reference-model helper passes to initialize before the Trainer has filled the config.
_TRL_REF = {"train_batch_size": 8, "gradient_clipping": "auto", "steps_per_print": "auto",
            "zero_optimization": {"stage": 3, "overlap_comm": "auto", "reduce_bucket_size": "auto",
                                  "stage3_prefetch_bucket_size": "auto",
                                  "offload_param": {"device": "none", "pin_memory": "auto"}},
            "fp16": {"enabled": "auto"},
            "zero_optimization.reduce_bucket_size": 1024,
            "zero_optimization.stage3_param_persistence_threshold": 320,
            "zero_optimization.stage3_prefetch_bucket_size": 921.6}


def test_unfilled_auto_is_the_default_and_said_once() -> None:
    """As DeepSpeed, an "auto" no Trainer filled means the default; the note names every key."""
    cfg = load_config(_TRL_REF, 2)
    default = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3}}, 2)
    assert cfg.zero_optimization == default.zero_optimization
    assert (cfg.gradient_clipping, cfg.steps_per_print, cfg.fp16) == \
        (default.gradient_clipping, default.steps_per_print, default.fp16)
    auto = [n for n in cfg.notes if n.startswith("'auto'")]
    assert len(auto) == 1 and len(cfg.notes) == 3  # "auto", dotted keys, steps_per_print's default
    for key in ("gradient_clipping", "steps_per_print", "zero_optimization.overlap_comm",
                "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                "zero_optimization.offload_param.pin_memory", "fp16.enabled"):
        assert f"'{key}'" in auto[0]
    assert cfg.raw["zero_optimization"]["reduce_bucket_size"] == "auto"  # engine.config: as given
    assert load_config({"train_batch_size": 8, "steps_per_print": 10}, 2).notes == ()


def test_dotted_top_level_keys_are_ignored_with_one_note() -> None:
    """DeepSpeed ignores TRL's "zero_optimization.x" keys; dslaunch too, and says so."""
    cfg = load_config(_TRL_REF, 2)
    dotted = [n for n in cfg.notes if n.startswith("top-level keys")]
    assert len(dotted) == 1 and "'zero_optimization.stage3_prefetch_bucket_size'" in dotted[0]
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 100_000  # ignored, as DeepSpeed


def test_typos_stay_errors_in_client_forms() -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization.reduce_bucket_sise": 5})
    assert msg.startswith("'zero_optimization.reduce_bucket_sise': unknown key") and \
        "did you mean 'reduce_bucket_size'" in msg
    assert "did you mean 'zero_optimization'" in _error({"train_batch_size": 8, "zero_optimisation.stage": 2})
    assert "did you mean 'overlap_comm'" in _error({"train_batch_size": 8,
                                                    "zero_optimization": {"overlap_com": "auto"}})


def test_unimplemented_keys_are_reported_not_ignored() -> None:
    assert "not implemented" in _error({"train_batch_size": 8, "hybrid_engine": {"enabled": True,
                                                                                "inference_tp_size": 2}})
    assert "not implemented" in _error({"train_batch_size": 8, "data_efficiency": {
        "data_routing": {"random_ltd": {"enabled": True, "total_layer_num": 2, "random_ltd_layer_num": 1,
                                        "random_ltd_layer_id": [1], "layer_token_lr_schedule": {"enabled": True},
                                        "random_ltd_schedule": {"min_value": 8, "max_value": 16, "schedule_config": {
                                            "require_steps": 10, "seq_per_step": 8}}}}}})
    # partial offload is implemented now (stage 3, tests/runtime/zero/test_offload_ratio.py)
    zero = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, 2).zero_optimization
    assert zero.offload_optimizer.ratio == 0.5
    # switched off, they are honoured as such
    cfg = load_config({"train_batch_size": 8, "tensorboard": {"enabled": False},
                       "zero_optimization": {"offload_optimizer": {"device": "none"}}}, 2)
    assert cfg.zero_optimization.stage == 0


def test_offload_param_nvme_and_max_in_cpu() -> None:
    """NVMe for parameters is implemented: ``max_in_cpu`` is read (DeepSpeed's 1e9 default)."""
    zero = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 1e6}}}, 2).zero_optimization
    assert zero.offload_param.device == "nvme" and zero.offload_param.max_in_cpu == 1_000_000
    assert load_config({"train_batch_size": 8}, 2).zero_optimization.offload_param.max_in_cpu == 10**9
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/tmp", "max_in_cpu": -1}}})
    assert "'zero_optimization.offload_param.max_in_cpu'" in msg


def test_fp16_and_bf16_together_is_an_error() -> None:
    assert "both" in _error({"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_optimizer_params_are_validated_at_parse_time() -> None:
    msg = _error({"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lrr": 1e-3}}})
    assert "'optimizer.params.lrr'" in msg and "did you mean 'lr'" in msg


def test_files_json_and_yaml_and_source_named(tmp_path) -> None:
    good = {"train_batch_size": 8, "zero_optimization": {"stage": 2}, "bfloat16": {"enabled": True},
            "checkpoint": {"tag_validation": "fail", "keep_last": 2}}
    (tmp_path / "c.json").write_text(json.dumps(good))
    (tmp_path / "c.yaml").write_text("train_batch_size: 8\nzero_optimization:\n  stage: 2\n")
    cfg = load_config(str(tmp_path / "c.json"), 2)
    assert cfg.bf16.enabled and cfg.checkpoint.tag_validation == "Fail" and cfg.checkpoint.keep_last == 2
    assert load_config(tmp_path / "c.yaml", 2).zero_optimization.stage == 2
    (tmp_path / "bad.json").write_text('{"train_batch_size": 8,\n "stage": 1}')
    msg = _error(str(tmp_path / "bad.json"))
    assert str(tmp_path / "bad.json") in msg and "'stage'" in msg
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,,}')
    assert "line 1" in _error(str(tmp_path / "broken.json"))
    assert "cannot read" in _error(str(tmp_path / "missing.json"))


@pytest.mark.timeout(30)
def test_initialize_rejects_a_bad_config_before_waiting_for_peers(monkeypatch) -> None:
    import torch

    import dslaunch

    # Rank 0 of a 2-rank job whose peer never comes: the config error must come first, not a hang.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="did you mean 'train_batch_size'"):
        dslaunch.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_sze": 4})


def _ok(extra: dict) -> object:
    return load_config({"train_batch_size": 8, **extra}, 2)


@pytest.mark.parametrize("key", ["reduce_scatter", "allgather_partitions", "use_multi_rank_bucket_allreduce",
                                 "round_robin_gradients", "elastic_checkpoint"])
def test_zero_knobs_without_effect_on_results_accept_both_values(key: str) -> None:
    for value in (True, False):
        assert getattr(_ok({"zero_optimization": {"stage": 2, key: value}}).zero_optimization, key) is value
    assert "true or false" in _error({"train_batch_size": 8, "zero_optimization": {key: "yes"}})


@pytest.mark.parametrize("stage", [1, 2])
def test_an_odd_allgather_bucket_size_is_refused_at_stages_1_and_2_as_deepspeed_asserts(stage: int) -> None:
    raw = {"train_batch_size": 8, "zero_optimization": {"stage": stage, "allgather_bucket_size": 1001}}
    # an AssertionError too: DeepSpeed's stage 1/2 optimizer asserts, and scripts catch that
    with pytest.raises(AssertionError) as info:
        load_config(raw, 2)
    assert isinstance(info.value, BucketAlignmentError)
    msg = str(info.value)
    assert "'zero_optimization.allgather_bucket_size'" in msg and "got 1001" in msg and "such as 1000" in msg
    assert "allgather_bucket_size must be a multiple of nccl_start_alignment_factor" in msg
    assert _ok({"zero_optimization": {"stage": stage, "allgather_bucket_size": 1000}}).zero_optimization.allgather_bucket_size == 1000


@pytest.mark.parametrize("stage", [0, 3])
def test_an_odd_allgather_bucket_size_is_accepted_where_deepspeed_does_not_check_it(stage: int) -> None:
    zero = _ok({"zero_optimization": {"stage": stage, "allgather_bucket_size": 1001}}).zero_optimization
    assert zero.allgather_bucket_size == 1001


def test_elastic_checkpoint_at_stage_3_warns_that_it_has_no_effect() -> None:
    import logging

    from dslaunch.runtime.zero.config import DeepSpeedZeroConfig

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    deepspeed_logger = logging.getLogger("DeepSpeed")  # dslaunch.utils.logger (not propagated)
    deepspeed_logger.addHandler(handler)
    try:
        DeepSpeedZeroConfig(stage=2, elastic_checkpoint=True)
        _ok({"zero_optimization": {"stage": 3, "elastic_checkpoint": False}})
        assert seen == []
        _ok({"zero_optimization": {"stage": 3, "elastic_checkpoint": True}})
        DeepSpeedZeroConfig(stage=3, elastic_checkpoint=True)
    finally:
        deepspeed_logger.removeHandler(handler)
    assert len(seen) == 2 and all(m.startswith("zero_optimization.elastic_checkpoint: ZeRO-3 elastic "
                                               "checkpointing is deprecated") and "no effect" in m for m in seen)


@pytest.mark.parametrize("key, instead", [("ignore_unused_parameters", "zero gradient"),
                                          ("load_from_fp32_weights", "fp32 copy")])
def test_zero_knobs_dslaunch_honours_one_way_reject_the_other(key: str, instead: str) -> None:
    assert getattr(_ok({"zero_optimization": {key: True}}).zero_optimization, key) is True
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 1, key: False}})
    assert msg.startswith(f"'zero_optimization.{key}': false is not implemented")
    assert instead in msg and msg.endswith("set it to true")


@pytest.mark.parametrize("value", [True, False])
def test_contiguous_gradients_is_a_layout_knob_taking_either_value(value: bool) -> None:
    # as reduce_scatter / allgather_partitions: DeepSpeed's configs set it either way, results are the same
    cfg = _ok({"zero_optimization": {"stage": 2, "contiguous_gradients": value}})
    assert cfg.zero_optimization.contiguous_gradients is value
    assert "'zero_optimization.contiguous_gradients'" in _error({"train_batch_size": 8, "zero_optimization": {
        "contiguous_gradients": "no"}})


@pytest.mark.parametrize("raw, path", [
    ({"checkpoint": {"parallel_write": {"pipeline_stage": True}}}, "checkpoint.parallel_write.pipeline_stage"),
    ({"timers": {"throughput": {"enabled": True}}}, "timers.throughput.enabled"),
])
def test_a_section_without_a_flag_is_off_only_at_its_off_values(raw: dict, path: str) -> None:
    msg = _error({"train_batch_size": 8, **raw})
    assert msg.startswith(f"'{path}': is accepted by DeepSpeed but not implemented by dslaunch yet")


def test_sections_at_their_off_values_are_accepted() -> None:
    _ok({"data_types": {"grad_accum_dtype": None}, "checkpoint": {"parallel_write": {"pipeline_stage": False}},
         "timers": {"throughput": {"enabled": False, "synchronized": False}},
         "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None},
         "pipeline": {"stages": "auto", "partition": "best"},
         # a switch set to off makes the rest of its section irrelevant, as in DeepSpeed
         "tensorboard": {"enabled": False, "output_path": "runs/"},
         "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False},
                                                          "different_groups": {"wq1": {}}}},
         "zero_optimization": {"offload_optimizer": {"device": "none", "pin_memory": True}},
         # only tune rejected features (NVMe offload, offloaded CPU optimizer): any value
         "aio": {"block_size": 1048576}, "zero_force_ds_cpu_optimizer": False})


@pytest.mark.parametrize("key, on, off", [
    ("seq_parallel_communication_data_type", "bf16", "fp32"),
    ("amp", {"enabled": True, "opt_level": "O1"}, {"enabled": False, "opt_level": "O1"}),
    ("sparse_gradients", True, False), ("memory_breakdown", True, False), ("dump_state", True, False),
    ("graph_harvesting", True, False),
    ("compile", {"deepcompile": True}, {"deepcompile": False}),
])
def test_deepspeed_keys_are_not_implemented_not_unknown(key: str, on: object, off: object) -> None:
    msg = _error({"train_batch_size": 8, key: on})
    # what DeepSpeed 0.19.8 removed is said to be gone, the rest to be not yet in dslaunch
    said = "was removed from DeepSpeed in 0.19.8" if key in REMOVED_FROM_DEEPSPEED else "not implemented by dslaunch yet"
    assert msg.startswith(f"'{key}") and said in msg and "unknown" not in msg
    _ok({key: off})


def test_sparse_gradients_names_what_to_do_instead() -> None:
    assert _error({"train_batch_size": 8, "sparse_gradients": True}) == (
        "'sparse_gradients': was removed from DeepSpeed in 0.19.8 (sparse exchange of dense embedding "
        "gradients; an nn.Embedding(sparse=True) trains without the key) and dslaunch does not have it; "
        "remove it (or set it to false)")


@pytest.mark.parametrize("key, on, off", [
    ("mics_shard_size", 2, -1), ("mics_hierarchical_params_gather", True, False),
    ("zeropp_loco_param", {"err_beta": 0.8, "reset_T": 1024}, None),
])
def test_zero_keys_deepspeed_removed_are_said_to_be_gone(key: str, on: object, off: object) -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, key: on}})
    assert msg.startswith(f"'zero_optimization.{key}': was removed from DeepSpeed in 0.19.8 (")
    assert msg.endswith(f"and dslaunch does not have it; remove it (or set it to {json.dumps(off)})")
    _ok({"zero_optimization": {"stage": 3, key: off}})


@pytest.mark.parametrize("raw, path", [
    ({"optimizer": {"type": "AdamW", "legacy_fusion": True}}, "optimizer.legacy_fusion"),
    ({"checkpoint": {"writer": {"type": "fast"}}}, "checkpoint.writer"),
])
def test_deepspeed_keys_inside_sections_are_not_implemented_not_unknown(raw: dict, path: str) -> None:
    assert _error({"train_batch_size": 8, **raw}).startswith(f"'{path}': is accepted by DeepSpeed but not "
                                                             "implemented by dslaunch yet")


def test_a_typo_inside_an_unimplemented_section_is_named() -> None:
    msg = _error({"train_batch_size": 8, "amp": {"enable": True}})
    assert msg.startswith("'amp.enable': is not a known key of 'amp' (did you mean 'enabled'?)")
    assert "did you mean 'tensorboard'" in _error({"train_batch_size": 8, "tensorbord": {"enabled": False}})


def test_stage3_keys_accept_auto_below_stage_3() -> None:
    # The Hugging Face Trainer writes "auto" into these; below stage 3 they configure nothing.
    cfg = _ok({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": "auto",
                                     "stage3_param_persistence_threshold": "auto", "sub_group_size": "auto",
                                     "stage3_gather_16bit_weights_on_model_save": "auto"}})
    assert cfg.zero_optimization.stage == 2


def test_stage3_keys_under_both_spellings_and_auto() -> None:
    """DeepSpeed's stage-3 knobs are read with or without the ``stage3_`` prefix; "auto" (left by
    a Trainer that did not fill it) keeps the default; a bad value names the key."""
    zero = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 1e4, "prefetch_bucket_size": "auto",
        "max_live_parameters": 3, "stage3_gather_fp16_weights_on_model_save": True}}, 2).zero_optimization
    assert (zero.stage3_param_persistence_threshold, zero.stage3_prefetch_bucket_size,
            zero.stage3_max_live_parameters, zero.stage3_gather_16bit_weights_on_model_save) == \
        (10_000, 50_000_000, 3, True)
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": -1}})
    assert "'zero_optimization.stage3_max_reuse_distance'" in msg


def test_cpu_offload_at_the_stages_that_have_it(caplog) -> None:
    """offload_optimizer at stages 1-3, offload_param at stage 3 (below it DeepSpeed ignores it:
    so does dslaunch, with a warning); NVMe-only keys change nothing."""
    zero = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
        "offload_param": {"device": "cpu", "nvme_path": None}}}, 2).zero_optimization
    assert zero.offload_optimizer.enabled and zero.offload_optimizer.pin_memory and zero.offload_param.enabled
    assert "needs ZeRO stage 1, 2 or 3" in _error({"train_batch_size": 8, "zero_optimization": {
        "offload_optimizer": {"device": "cpu"}}})
    below = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_param": {"device": "cpu"}}}, 2).zero_optimization
    assert not below.offload_param.enabled
    assert "offload_param: has no effect at ZeRO stage 2" in caplog.text
    assert "did you mean 'device'" in _error({"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"devce": "cpu"}}})


@pytest.mark.parametrize("key, suggestion", [
    ("stage3_max_live_parametrs", "stage3_max_live_parameters"),
    ("stage3_prefetch_bucket_sise", "stage3_prefetch_bucket_size"),
    ("max_live_parameters_x", "stage3_max_live_parameters"),
    ("sub_group_sizes", "sub_group_size"),
])
def test_a_misspelt_stage3_key_is_unknown_with_a_suggestion(key: str, suggestion: str) -> None:
    """Any ``stage3_*`` key (and these prefixes) used to be accepted, leaving the default silently."""
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, key: 5}})
    assert msg.startswith(f"'zero_optimization.{key}': unknown parameter for section 'zero_optimization' (did "
                          f"you mean '{suggestion}'?)"), msg


@pytest.mark.parametrize("first, second", [
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size"),
    ("stage3_max_live_parameters", "max_live_parameters"),
    ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"),
    ("model_persistence_threshold", "stage3_model_persistence_threshold"),
])
def test_both_spellings_of_one_stage3_key_is_a_conflict_named(first: str, second: str) -> None:
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, first: 1, second: 2}})
    assert msg == (f"'zero_optimization.{second}': sets the same thing as 'zero_optimization.{first}' (two "
                   "spellings of one setting); keep one")


def test_an_offload_key_of_the_other_section_is_refused() -> None:
    """``offload_param.ratio`` and ``offload_optimizer.max_in_cpu`` were accepted and read by no one."""
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu", "ratio": 0.5}}})
    assert msg.startswith("'zero_optimization.offload_param.ratio': is not read in this section: it is an "
                          "offload_optimizer key") and msg.endswith("; remove it")
    msg = _error({"train_batch_size": 8, "zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/tmp", "max_in_cpu": 10}}})
    assert msg.startswith("'zero_optimization.offload_optimizer.max_in_cpu': is not read in this section: it is "
                          "an offload_param key")
    zero = _ok({"zero_optimization": {"stage": 3, "stage3_model_persistence_threshold": 5,
                                      "offload_param": {"device": "cpu", "max_in_cpu": 10}}}).zero_optimization
    assert zero.offload_param.max_in_cpu == 10  # each key in its own section stays valid


def test_sequence_parallel_size_divides_the_world_before_the_batch_triad() -> None:
    """DeepSpeed's rule without an mpu: the sequence ranks of a sample are one data-parallel rank."""
    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2}, 8)
    assert (cfg.world_size, cfg.gradient_accumulation_steps, cfg.sequence_parallel_size) == (4, 1, 2)
    # an mpu's data-parallel size is not divided again
    assert load_config({"train_batch_size": 8, "sequence_parallel_size": 2}, 4, global_world=False).world_size == 4
    assert _error({"train_batch_size": 8, "sequence_parallel_size": 4}, 6) == (
        "'sequence_parallel_size': sequence_parallel_size=4 must divide the world size 6")
    assert "sequence_parallel_size" in _error({"train_batch_size": 8, "sequence_parallel_size": 0})


def test_booleans_take_1_and_0_as_deepspeed_reads_them() -> None:
    assert _ok({"zero_allow_untested_optimizer": 1}).zero_allow_untested_optimizer is True
    assert _ok({"dataloader_drop_last": 0}).dataloader_drop_last is False
    for bad in (2, "true", 1.0):
        assert "must be true or false (or 1 or 0)" in _error({"train_batch_size": 8, "dataloader_drop_last": bad})


@pytest.mark.parametrize("given, read", [("fp32", "fp32"), ("float32", "fp32"), ("float", "fp32"),
                                         ("torch.float32", "fp32"), ("bfloat16", "bf16"), (None, None)])
def test_grad_accum_dtype_takes_deepspeeds_spellings(given: str | None, read: str | None) -> None:
    cfg = load_config({"train_batch_size": 8, "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": given}}, 2)
    assert cfg.data_types.grad_accum_dtype == read and cfg.grad_accum_dtype == read  # DeepSpeed's attribute too


@pytest.mark.parametrize("raw, says", [
    ({"data_types": {"grad_accum_dtype": "fp64"}}, "must be \"fp32\", \"fp16\" or \"bf16\""),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "\"bf16\" with an fp32 model is not supported"),
    ({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp16"}},
     "\"fp16\" with a bf16 model is not supported: gradients are summed in the model's dtype, or in fp32 for an "
     "fp16/bf16 model; set it to \"fp32\" or \"bf16\""),
    ({"fp16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}, "set it to \"fp32\" or \"fp16\""),
])
def test_grad_accum_dtype_refusals_name_the_key(raw: dict, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, **raw}, 2)
    msg = str(info.value)
    assert msg.startswith("'data_types.grad_accum_dtype': ") and says in msg and "\n" not in msg
    # an unsupported mix is also what DeepSpeed raises for one (a bad spelling stays a ValueError)
    assert isinstance(info.value, NotImplementedError) == ("not supported" in msg)


def test_immediate_grad_update_is_a_bf16_key() -> None:
    for value in (True, False):
        cfg = load_config({"train_batch_size": 8, "bf16": {"enabled": True, "immediate_grad_update": value}}, 2)
        assert cfg.bf16.immediate_grad_update is value
    assert load_config({"train_batch_size": 8}, 2).bf16.immediate_grad_update is False  # DeepSpeed 0.19.8's default
    assert "'bf16.immediate_grad_update'" in _error({"train_batch_size": 8, "bf16": {"immediate_grad_update": "on"}})
