"""``dslaunch.initialize`` and friends: DeepSpeed's entry points, same signatures and returns.

``initialize`` validates the config once (``config.load_config``), sets up the process group if
needed and returns ``(engine, optimizer, training_dataloader, lr_scheduler)`` exactly like
``deepspeed.initialize``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import ConfigError, ModelRequiredError, install_excepthook
from dslaunch.runtime.config import load_config
from dslaunch.runtime.dist import discovered_env, init_distributed
from dslaunch.runtime.shutdown import register_clean_exit
from dslaunch.runtime.tensor_parallel.mode import set_autotp_mode
from dslaunch.runtime.tensor_parallel.training import tp_model_init, with_tp_model_init
from dslaunch.utils.logging import logger
from dslaunch.utils.restart import restart_count, resume_dir

__all__ = ["initialize", "init_distributed", "add_config_arguments", "tp_model_init", "DeepSpeedOptimizerCallable",
           "DeepSpeedSchedulerCallable"]

# DeepSpeed's type hints for what ``initialize`` takes as ``optimizer`` / ``lr_scheduler`` callables
DeepSpeedOptimizerCallable = Callable[[Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]]], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def initialize(args: Any = None, model: Any = None, optimizer: Any = None, model_parameters: Any = None,
               training_data: Any = None, lr_scheduler: Any = None, distributed_port: int = 29500,
               mpu: Any = None, dist_init_required: bool | None = None, collate_fn: Any = None,
               config: Any = None, mesh_param: tuple[int, int] | None = None,
               config_params: Any = None) -> tuple[Any, Any, Any, Any]:
    """Build a training engine around ``model``.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is used when ``config`` is None.
        model: the ``torch.nn.Module`` to train.
        optimizer: a ``torch.optim.Optimizer`` or a callable ``params -> optimizer`` (else the
            config's ``optimizer`` section is used).
        model_parameters: tensors or param-group dicts to optimize (default: all trainable).
        training_data: a ``torch.utils.data.Dataset``; a distributed loader is returned for it.
        lr_scheduler: a scheduler object or a callable ``optimizer -> scheduler``.
        distributed_port: MASTER_PORT when the environment does not set one.
        mpu: a Megatron-style model-parallel unit (``get_data_parallel_group/rank/world_size``,
            ``get_model_parallel_group/rank/world_size``; a ``pipe.topology.PipelineParallelGrid``
            is one), built on an initialised torch.distributed: the batch sizes, the loader and
            ZeRO use its data-parallel group, the gradient norm is agreed over its model-parallel
            group. None: every rank is a data-parallel peer.
        dist_init_required: False never initialises torch.distributed; None does so if needed.
        collate_fn: passed to the training data loader.
        config / config_params: the ds_config (dict or JSON/YAML path).
        mesh_param: DeepSpeed's ``(data_parallel_size, sequence_parallel_size)``: the same as those
            two config keys (Ulysses: each run of ``sequence_parallel_size`` neighbouring ranks
            splits a sequence).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)``; the loader and scheduler are
        None when not requested. In a restarted run of a job launched with ``--resume_from DIR``
        the engine has already loaded the newest valid checkpoint in DIR (weights, optimizer,
        counters, data position, RNG), as ``engine.load_checkpoint(DIR)`` would.

    Raises:
        ConfigError: invalid config (named key path), or configs given twice.

    collective: call on all ranks.
    """
    install_excepthook()  # a config mistake reads as one line in the worker's output
    if model is None:
        where = " (the first positional argument is args, as in DeepSpeed)" if args is not None else ""
        raise ModelRequiredError(f"initialize() needs model=<torch.nn.Module>{where}")
    source = with_tp_model_init(_config_source(args, config if config is not None else config_params), model, mpu)
    if mesh_param is not None:
        source = _with_mesh(source, mesh_param)
    # Validate before any rendezvous: a config mistake must not wait for (or hang) peers.
    will_init = not dist.is_initialized() and dist_init_required is not False
    if will_init:
        os.environ.update(discovered_env(os.environ))  # a task srun or mpirun started: the world size is theirs
    world = (dist.get_world_size() if dist.is_initialized()
             else int(os.environ.get("WORLD_SIZE", "1")) if will_init else 1)
    pipeline = _is_pipeline_module(model)
    if pipeline:
        if mpu is not None:
            raise ConfigError("initialize(mpu=...) with a PipelineModule: the module's own grid is the mpu; "
                              "remove mpu= (give the PipelineModule a topology instead)")
        mpu = model.mpu()
    if mpu is not None:
        world = _checked_mpu(mpu).get_data_parallel_world_size()  # the batch is split over replicas
    # Without an mpu the config's own degrees (tensor_parallel.autotp_size) split the world.
    cfg = load_config(source, world, global_world=mpu is None)
    if cfg.tensor_parallel.autotp_size > 0:  # DeepSpeed's process-wide mode (hand-built layers read it)
        set_autotp_mode(training=True)
    if pipeline and cfg.tensor_parallel.size > 1:
        raise ConfigError("AutoTP training with a PipelineModule is not implemented: remove tensor_parallel, or "
                          "train the model without deepspeed.pipe", key="tensor_parallel.autotp_size")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required,
                     verbose=False, config=cfg)
    parts = {"optimizer": optimizer, "model_parameters": model_parameters, "training_data": training_data,
             "lr_scheduler": lr_scheduler, "collate_fn": collate_fn}
    if pipeline:
        if cfg.hybrid_engine.enabled:
            raise ConfigError("the hybrid engine generates with the whole model: it does not run a PipelineModule; "
                              "set it to false", key="hybrid_engine.enabled")
        from dslaunch.runtime.pipe.dualpipev import DualPipeVEngine, DualPipeVModule
        from dslaunch.runtime.pipe.engine import PipelineEngine

        # as DeepSpeed: the DualPipeV engine for its module, the pipeline engine for any other
        engine_class = DualPipeVEngine if isinstance(model, DualPipeVModule) else PipelineEngine
        engine: Any = engine_class(model, cfg, **parts)
    elif cfg.hybrid_engine.enabled:  # DeepSpeed's class for it: the training engine that also generates
        from dslaunch.runtime.hybrid_engine import DeepSpeedHybridEngine

        engine = DeepSpeedHybridEngine(model, cfg, mpu=mpu, **parts)
    else:
        from dslaunch.runtime.engine import DeepSpeedEngine

        engine = DeepSpeedEngine(model, cfg, mpu=mpu, **parts)
    register_clean_exit(engine)
    if engine.global_rank == 0:
        for note in cfg.notes:  # what the config says that was read differently (client_forms.py)
            print(f"dslaunch: note: {note}", flush=True)
    resume = resume_dir()
    if _resumed_from_memory(engine, cfg, resume):
        resume = None
    if resume is not None:  # a restarted run of a job launched with --resume_from
        loaded, _ = engine.load_checkpoint(resume)
        if loaded is None:
            # Starting over would look like a resumed run that then trains for too long (a typo in
            # --resume_from, or a script that saves elsewhere): stop before any step, every rank.
            if engine.global_rank == 0:
                what = "holds no checkpoint" if os.path.isdir(resume) else "does not exist"
                print(f"dslaunch: error: restart {restart_count()} of the job cannot resume: --resume_from "
                      f"{resume} {what} (the script must save its checkpoints into that directory); not "
                      "starting over at step 0", file=sys.stderr, flush=True)
            raise SystemExit(2)
        if engine.memory_checkpoint is not None:
            engine.memory_checkpoint.report_storage_resume(engine.global_rank, engine.global_steps)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _resumed_from_memory(engine: Any, cfg: Any, storage_dir: str | None) -> bool:
    """With a ``memory_checkpoint`` block: attach the engine's memory snapshots and, in a restarted
    run, load the newest complete one unless storage holds a newer checkpoint. collective."""
    if not cfg.memory_checkpoint.enabled:
        return False
    from dslaunch.runtime.checkpoint.memory import attach

    memory = attach(engine, cfg.memory_checkpoint)
    if memory is None or restart_count() == 0:
        return False
    resumed = memory.resume(engine.checkpoint_parts(), storage_dir,
                            lambda folder, tag: engine.load_checkpoint(folder, tag=tag))
    return resumed is not None


def _is_pipeline_module(model: Any) -> bool:
    from dslaunch.runtime.pipe.module import PipelineModule

    return isinstance(model, PipelineModule)


_MPU_METHODS = tuple(f"get_{axis}_parallel_{what}" for axis in ("data", "model")
                     for what in ("group", "rank", "world_size"))


def _checked_mpu(mpu: Any) -> Any:
    """An mpu answers Megatron's six questions, on an initialised torch.distributed."""
    missing = [m for m in _MPU_METHODS if not callable(getattr(mpu, m, None))]
    if missing:
        raise ConfigError(f"initialize(mpu=...): {type(mpu).__name__} lacks {', '.join(missing)}; an mpu "
                          "must answer Megatron's get_{data,model}_parallel_{group,rank,world_size}")
    if not dist.is_initialized():
        raise ConfigError("initialize(mpu=...) needs torch.distributed initialised first (the mpu's groups "
                          "live in it): call deepspeed.init_distributed() before building the mpu")
    from dslaunch.runtime.parallel.dims import mpu_problem

    problem = mpu_problem(mpu, dist.get_world_size())
    if problem is not None:
        raise ConfigError(problem)
    return mpu


def _with_mesh(source: Any, mesh_param: Any) -> Any:
    """The config ``source`` (a dict copy; a file is read) with ``initialize(mesh_param=(dp, sp))``
    as its ``data_parallel_size`` and ``sequence_parallel_size``.

    Raises:
        ConfigError: ``mesh_param`` is not two integers >= 1, or the config states other sizes.
    """
    from dslaunch.runtime.config.file import read_config_file

    sizes = tuple(mesh_param) if isinstance(mesh_param, tuple | list) else ()
    if len(sizes) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes):
        raise ConfigError(f"initialize(mesh_param={mesh_param!r}): give (data_parallel_size, "
                          "sequence_parallel_size), two integers >= 1")
    raw = {} if source is None else source if isinstance(source, Mapping) else read_config_file(Path(source))
    if not isinstance(raw, Mapping):
        return raw  # load_config says what is wrong with it
    mesh = dict(zip(("data_parallel_size", "sequence_parallel_size"), sizes, strict=True))
    for key, size in mesh.items():
        if raw.get(key, size) != size:
            raise ConfigError(f"{raw[key]!r}, but initialize(mesh_param={mesh_param!r}) says {size}; make them "
                              "equal or drop one", key=key)
    return {**raw, **mesh}


def _config_source(args: Any, config: Any) -> Any:
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated (DeepSpeed's old name): use --deepspeed_config")
        from_args = args.deepscale_config
    if config is not None and from_args is not None:
        raise ConfigError("a config was given both as --deepspeed_config and to initialize(config=...); "
                          "give exactly one")
    return config if config is not None else from_args


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed`` and ``--deepspeed_config`` flags to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on dslaunch)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json/yaml configuration file.")
    # DeepSpeed's deprecated spellings, still read by initialize(args=...)
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
