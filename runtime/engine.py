"""The training engine: a thin DeepSpeed-compatible front over a ZeRO strategy.

``forward``/``backward``/``step`` delegate: the ZeRO strategy (picked once from the registry) owns
parameters, gradients, communication and the optimizer step; the precision policy owns dtypes;
the loss scaler owns scaling and overflow bookkeeping; checkpoints live in
``dslaunch.runtime.checkpoint`` (the engine's checkpoint methods: ``engine_checkpoint``). The
engine keeps only the counters; the accumulation clock (which micro step is a boundary, ``no_sync``)
is ``engine_accumulation``'s.

As in DeepSpeed the engine is an ``nn.Module`` around ``module``: ``state_dict()`` and
``load_state_dict()`` are the module weights under a ``module.`` prefix; the counters the
checkpoint needs are ``engine_state_dict()`` / ``load_engine_state_dict()``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import UsageError, quote
from dslaunch.runtime.accelerator import get_accelerator
from dslaunch.runtime.activation_checkpointing import checkpointing
from dslaunch.runtime.activation_checkpointing.offload_activations import CheckpointHiddenStatesOffload
from dslaunch.runtime.api import (  # DeepSpeed's path for them
    DeepSpeedOptimizerCallable,
    DeepSpeedSchedulerCallable,
)

# DeepSpeed's private name, which its reshape tests import from the engine module
from dslaunch.runtime.checkpoint.deepspeed_checkpoint import (
    checkpoint_parallel_metadata as _checkpoint_parallel_metadata,  # noqa: F401
)
from dslaunch.runtime.compression.training import CompressionTraining
from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.data_pipeline.curriculum_scheduler import legacy_scheduler
from dslaunch.runtime.data_pipeline.data_routing.wiring import random_ltd_scheduler
from dslaunch.runtime.dist import device_for, local_rank
from dslaunch.runtime.engine_accumulation import MEMORY_OPT_ALLREDUCE_SIZE, EngineAccumulation
from dslaunch.runtime.engine_checkpoint import EngineCheckpoints
from dslaunch.runtime.engine_settings import EngineSettings
from dslaunch.runtime.engine_setup import (
    build_components,
    data_loader,
    refuse_sequence_conflicts,
    sequence_size,
)
from dslaunch.runtime.events import StepRecord
from dslaunch.runtime.heartbeat import reporter
from dslaunch.runtime.observers import build_observers
from dslaunch.runtime.parallel import deepspeed_groups as groups
from dslaunch.runtime.parallel.from_config import grid_from_config
from dslaunch.runtime.parallel.mpu import gradient_reduce_group, tensor_axis
from dslaunch.runtime.plain_backward import PlainBackward
from dslaunch.runtime.precision import PrecisionPolicy
from dslaunch.runtime.progressive_layer_drop import ProgressiveLayerDrop
from dslaunch.runtime.python_gc import PYTHON_GC
from dslaunch.runtime.torch_autocast import Autocast
from dslaunch.runtime.zero.config import OffloadDeviceEnum
from dslaunch.runtime.zero.optimizer_view import optimizer_for, take_step
from dslaunch.utils.logging import set_log_level_from_string
from dslaunch.utils.restart import PREEMPTED_EXIT_CODE

__all__ = ["DeepSpeedEngine", "MEMORY_OPT_ALLREDUCE_SIZE", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]


class DeepSpeedEngine(EngineAccumulation, EngineCheckpoints, EngineSettings, torch.nn.Module):
    """Wraps ``module`` for data-parallel training configured by a ``DeepSpeedConfig``.

    Use ``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()`` every micro step;
    the optimizer step happens at each gradient accumulation boundary.

    collective: construct, ``backward`` and ``step`` on all ranks.
    """

    # DeepSpeed's names of the embeddings reduced as sparse tensors: none (sparse_gradients is refused)
    sparse_tensor_module_names: frozenset[str] = frozenset()

    def __init__(self, model: torch.nn.Module, config: DeepSpeedConfig, optimizer: Any = None,
                 model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
                 collate_fn: Any = None, mpu: Any = None):
        super().__init__()
        # Where this rank sits: a Megatron-style mpu, else the axes the config sets (AutoTP's tensor
        # slices, sequence_parallel_size), else every rank a data-parallel peer.
        refuse_sequence_conflicts(config, mpu)  # before any group exists: a refusal must not strand a peer
        if mpu is None:
            mpu = grid_from_config(config)  # the config's grid answers as an mpu would (groups, ZeRO, ...)
        self.grid = groups.grid = mpu if mpu is not None else groups.data_parallel_grid()
        self.mpu = groups.mpu = mpu  # deepspeed.utils.groups answers from the last engine's
        self.sequence_parallel_size = sequence_size(self.grid)
        self.seq_parallel_group = self.grid.get_sequence_parallel_group() if self.sequence_parallel_size > 1 else None
        self.seq_data_parallel_group = gradient_reduce_group(self.grid)  # where gradients average (DeepSpeed's name)
        self.tp_plan = self._unchecked_tp_group = None
        if config.tensor_parallel.size > 1:  # AutoTP training: shard before anything reads the parameters
            from dslaunch.runtime.tensor_parallel.training import repoint_parameters, shard_for_training

            self.tp_plan, replaced = shard_for_training(model, self.grid, config)
            model_parameters = repoint_parameters(replaced, optimizer, model_parameters)
            self._unchecked_tp_group = tensor_axis(self.grid, "group")  # the first batch is compared over it
        if config.expert_parallel.enabled:  # AutoEP: this rank's experts only, before ZeRO sees the parameters
            from dslaunch.runtime.moe.autoep import convert_for_expert_parallel
            from dslaunch.runtime.tensor_parallel.training import repoint_parameters

            replaced = convert_for_expert_parallel(model, config.expert_parallel, config.use_data_before_expert_parallelism)
            model_parameters = repoint_parameters(replaced, optimizer, model_parameters)
        if "activation_checkpointing" in config.raw:  # deepspeed.checkpointing follows the block
            checkpointing.configure_from(config.activation_checkpointing, mpu)
        self._config = config
        # disable_python_gc: the process's collector off while this engine lives (destroy() gives it back)
        self._python_gc = PYTHON_GC.acquire() if config.disable_python_gc else None
        if config.log_level is not None:  # as DeepSpeed, before anything logs
            set_log_level_from_string(config.log_level)
        # DeepSpeed's engine.config is the ds_config dict as given (Hugging Face's Trainer reads it)
        self.config = dict(config.raw)
        self.local_rank = local_rank()
        self.device = device_for(self.local_rank)
        self.precision = PrecisionPolicy.from_config(config)
        self.module = self.precision.cast_model(model.to(self.device), config.data_types)
        _set_parallelism(self.module, config)
        parts = build_components(self.module, config, self.precision, optimizer, model_parameters,
                                 lr_scheduler, training_data, collate_fn, self.grid)
        self.zero, self.basic_optimizer, self.lr_scheduler = parts.zero, parts.optimizer, parts.lr_scheduler
        self.training_dataloader = parts.dataloader
        self.loss_scaler = PrecisionPolicy.loss_scaler(config)
        # A step with inf/NaN gradients is skipped under fp16, and under bf16 unless switched off (DeepSpeed's rules)
        self._skips_overflow = PrecisionPolicy.scales_loss(config) or (config.bf16.enabled and config.bf16.check_grad_overflow)
        # DeepSpeed's wrapper where it has one (ZeRO, 16-bit), else the torch optimizer (basic_optimizer)
        self.optimizer = optimizer_for(self.zero, self.basic_optimizer, config, self.loss_scaler, self._skips_overflow,
                                       PrecisionPolicy.scales_loss(config), weakref.WeakMethod(self.backward),
                                       self.pipeline_parallelism, from_config=optimizer is None)
        self._autocast = Autocast.from_config(config.torch_autocast, self.device)  # forwards under torch.autocast
        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.dp_world_size = self.grid.get_data_parallel_world_size()
        self.data_parallel_group = self.grid.get_data_parallel_group()  # DeepSpeed's attribute
        self.mp_world_size = self.grid.get_model_parallel_world_size()
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._step_applied = False
        self._grad_norm: float | None = None
        self._init_accumulation()
        self.is_compiled = False
        self._checkpointer: Any = None  # built (collectively) by the first save or load
        self.memory_checkpoint: Any = None  # a checkpoint.memory.MemoryCheckpoint (initialize() sets it)
        self._loss: torch.Tensor | None = None
        self._window_losses: list[torch.Tensor] = []  # this accumulation window's (StepRecord)
        self._heartbeat = reporter()  # None outside dslaunch
        self._plain = PlainBackward(self.gradient_accumulation_steps, self._backward_epilogue,
                                    PrecisionPolicy.scales_loss(config))
        half = config.fp16.enabled or config.bf16.enabled or config.torch_autocast.enabled
        self.curriculum_scheduler_legacy = legacy_scheduler(config.curriculum_learning, half)  # DeepSpeed's name
        self.random_ltd_scheduler = random_ltd_scheduler(config)  # DeepSpeed's name; None when off
        pld = config.progressive_layer_drop
        self.progressive_layer_drop = ProgressiveLayerDrop(pld.theta, pld.gamma) if pld.enabled else None
        self._compression = CompressionTraining(self.module, config.compression_training, config.fp16.enabled,
                                                config.zero_optimization.stage)
        # DeepSpeed's names: the scheduler (always there) and the MoQ quantizer (None unless asked for)
        self.compression_scheduler, self.quantizer = self._compression.scheduler, self._compression.quantizer
        if config.comms_logger.enabled:  # the process's one logger (a later engine without the block keeps it)
            from dslaunch.runtime.comm import comm

            comm.configure(config)
        built = build_observers(self, config, self._heartbeat, self._leave_on_request)
        self.events, self.timers = built.events, built.timers  # DeepSpeed's engine.timers
        self.flops_profiler = built.flops_profiler  # DeepSpeed's: the FlopsProfiler of the profiled step
        self.monitor = built.monitor  # DeepSpeed's engine.monitor
        self._work = built.work

    def __getattr__(self, name: str) -> Any:
        """The wrapped model's attributes the engine does not have (``engine.generate(...)``), as
        DeepSpeed's engine passes them through; the engine's own come first."""
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules (``module`` itself)
        except AttributeError as own:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            try:
                return getattr(module, name)
            except AttributeError:
                raise own from None  # names the engine, as DeepSpeed's message does

    # ----- training loop --------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._unchecked_tp_group is not None:  # AutoTP: the first batch is compared once
            from dslaunch.runtime.tensor_parallel.collectives import check_first_inputs

            group, self._unchecked_tp_group = self._unchecked_tp_group, None
            check_first_inputs((args, kwargs), group)
        self.zero.pre_forward()  # parameters gathered after the last step must be in place
        if self.optimizer is not None:
            # The micro step starts here too: with several engines under one loss, DeepSpeed's
            # users call loss.backward() themselves, and the gradient hooks read this state.
            self.zero.begin_micro_step(self.is_gradient_accumulation_boundary(), self._sync)
        # cpu_checkpointing: the hidden states Hugging Face's checkpointed layers save wait in host
        # memory (ALST's offload; deepspeed.checkpointing's own inputs follow the key in storage.py)
        offload = CheckpointHiddenStatesOffload() if self._config.activation_checkpointing.cpu_checkpointing \
            else contextlib.nullcontext()
        self._plain.begin_forward((args, kwargs))
        self._compression.before_forward(self.global_steps)
        if self._config.fp16.enabled and self._config.fp16.auto_cast:
            args = PrecisionPolicy.half_inputs(args)
        if self.module.training:  # what DeepSpeed's engine hands a training forward
            if self.progressive_layer_drop is not None:
                kwargs = {**kwargs, **self.progressive_layer_drop.get_state()}
            if self.curriculum_scheduler_legacy is not None:
                kwargs = self.curriculum_scheduler_legacy.forward_kwargs(kwargs, self.global_steps + 1)
            if self.random_ltd_scheduler is not None:  # at the step taken so far, as DeepSpeed's
                self.random_ltd_scheduler.update_seq(self.global_steps)
        with self.events.phase("forward"), offload, self._autocast():
            out = self.module(*args, **kwargs)
        # a script's own loss.backward() then trains as engine.backward(loss) (plain_backward.py)
        return self._plain.attach(out) if self.optimizer is not None and torch.is_grad_enabled() else out

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
                 ) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by the accumulation steps) and reduce gradients.

        collective: call on all ranks every micro step.
        """
        self.zero.begin_micro_step(self.is_gradient_accumulation_boundary(), self._sync)
        self._loss = loss.detach()  # for the heartbeat (read at most twice a second); not its graph
        self._window_losses.append(self._loss)
        if scale_wrt_gas and self._config.gradient_accumulation_steps > 1:
            loss = loss / self._config.gradient_accumulation_steps
        with self.events.phase("backward"), self._plain.engine_backward():
            self.loss_scaler.scale_loss(loss).backward(retain_graph=retain_graph)
        self._backward_epilogue()
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16; the loss itself otherwise), for a script's own
        backward: ``engine.scale(loss).backward()`` (DeepSpeed 0.19's name)."""
        self._plain.mark_scaled(loss)  # checks it is a loss
        return self.loss_scaler.scale_loss(loss)

    def _backward_epilogue(self) -> None:
        """After the backward pass: release what stage 3 gathered, complete the gradient reductions.

        DeepSpeed's name and contract for several engines trained under one loss: ``loss =
        sum(...)``, ``loss.backward()``, then ``engine._backward_epilogue()`` and ``engine.step()``
        on each engine (every rank, the same order). ``backward()`` calls it itself.

        collective: all ranks.
        """
        if self._plain.take_completed():  # the script's backward already ended with it
            return
        self._window_backwards += 1
        self.zero.post_backward()
        with self.events.phase("allreduce"):
            self.zero.end_backward()

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Count a micro step; at the accumulation boundary update the weights (with
        ``managed_gradient_accumulation: false`` every step is one: ``engine_accumulation``).

        An fp16 step whose gradients overflowed is skipped (``skipped_steps``), the loss scale is
        updated and the LR scheduler does not advance, as in DeepSpeed; so is a bf16 step with
        inf/NaN gradients (``bf16.check_grad_overflow``, default true).

        collective: call on all ranks every micro step.

        A backward of the script's own that reached none of the forward's outputs (it called
        ``engine.module`` itself) is completed here: reduced, not divided (``plain_backward.py``).

        Raises:
            NoSyncError: at an accumulation boundary inside ``no_sync()`` (the gradients are not
                reduced, so ranks would diverge; DeepSpeed asserts on any step there), or inside
                ``coalesce_grad_reduction()``.
            LossScalingRequiredError: after such a backward with fp16 without ``engine.scale``.
        """
        if self.zero.backward_pending:
            self._plain.finish_unhooked()
        with self._step_window() as boundary:
            if boundary:
                self._take_model_step(lr_kwargs)
            else:
                self._step_applied = False
        self.micro_steps += 1

    def _take_model_step(self, lr_kwargs: dict | None = None) -> None:
        """The optimizer step of an accumulation boundary, its counters and its ``StepRecord``
        (DeepSpeed's name; the pipeline engine calls it once per ``train_batch``).

        collective: all ranks.
        """
        if self.progressive_layer_drop is not None:  # before the step is counted, as DeepSpeed's
            self.progressive_layer_drop.update_state(self.global_steps)
        with self.events.phase("step"):
            result = take_step(self.zero, self.loss_scaler, self._config.gradient_clipping, self._skips_overflow)
        self._step_applied, self._grad_norm = not result.overflow, result.grad_norm
        self._compression.after_step(result.overflow)
        if result.overflow:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self._window_samples()
        self.events.step(self._step_record)
        self._window_losses = []
        if self.memory_checkpoint is not None and self.memory_checkpoint.due(self.global_steps):
            with self._checkpoint_phase():
                self.zero.synchronize()
                self.memory_checkpoint.snapshot(self.checkpoint_parts())

    def _step_record(self) -> StepRecord:
        return StepRecord(self.global_steps, self.global_samples, self.micro_steps, self._loss, tuple(self.get_lr()),
                          self.loss_scaler.loss_scale, self._grad_norm, not self._step_applied, self.skipped_steps,
                          tuple(self._window_losses), self._step_samples)

    def _leave_on_request(self, save_dir: str) -> None:
        """Every rank agreed on a checkpoint request (``runtime.preempt``): save this step, leave."""
        self.save_checkpoint(save_dir)
        if self.global_rank == 0:
            print(f"[dslaunch] checkpoint requested (pre-emption): step {self.global_steps} saved to "
                  f"{save_dir}; stopping with exit code {PREEMPTED_EXIT_CODE} to resume from it", flush=True)
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def zero_grad(self) -> None:
        self.zero.zero_grad()

    def deepspeed_io(self, dataset: Any, batch_size: int | None = None, route: str = "train",
                     pin_memory: bool = True, data_sampler: Any = None, collate_fn: Any = None,
                     num_local_io_workers: int | None = None) -> Any:
        """A loader of this data-parallel rank's share of ``dataset``, as DeepSpeed's (what
        ``initialize(training_data=...)`` returns): batches of ``batch_size`` (default the config's
        micro batch), ``data_sampler`` instead of the rank's shuffled share where given. ``route``
        (train/eval/predict) changes nothing here; ``pin_memory`` applies where CUDA is in use."""
        return data_loader(self._config, dataset, self.grid, batch_size, collate_fn, num_local_io_workers or 0,
                           pin_memory and self.device.type == "cuda", data_sampler)

    def empty_partition_cache(self) -> None:
        """Free the whole parameters ZeRO-3 gathered and still keeps, the persistent ones too
        (e.g. after ``eval`` or generation, before another model takes the memory), as DeepSpeed's;
        nothing below stage 3. The next forward (or step) gathers them again.

        collective: all ranks (the next forward re-gathers on every rank)."""
        self.zero.synchronize()
        self.zero.release_gathered(persistent=True)
        get_accelerator().empty_cache()

    def offload_states(self, include: Any = None, device: OffloadDeviceEnum = OffloadDeviceEnum.cpu,
                       pin_memory: bool = True, non_blocking: bool = False) -> None:
        """Move ZeRO's states to host memory between training phases (RLHF's generation), as
        DeepSpeed's: ``include`` a container of ``OffloadStateTypeEnum`` (None: every state),
        ``pin_memory`` page-locked host copies where an accelerator exists, ``non_blocking``
        asynchronous copies. The accelerator memory is freed; ``reload_states()`` brings the same
        tensors back, and training then continues exactly as without the round trip
        (``runtime/zero/offload_states.py``). Forward, backward and step refuse meanwhile what
        they would read offloaded. Unlike DeepSpeed's: any optimizer, and ZeRO stage 0 too.

        Raises:
            UsageError: no optimizer, ``offload_param`` configured, device ``nvme``, an unknown state.
        """
        strategy = self._offloading_strategy("offload_states")
        self.wait_for_checkpoint()  # an asynchronous save may still read the states
        strategy.offload_states(include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what ``offload_states`` moved (a no-op when nothing is offloaded).

        Raises:
            UsageError: the engine has no optimizer.
        """
        self._offloading_strategy("reload_states").reload_states(non_blocking)

    def _offloading_strategy(self, name: str) -> Any:
        if self.optimizer is None:  # DeepSpeed asserts the same
            raise UsageError(f"engine.{name}: moving states across devices is not supported without an "
                             "optimizer (this engine only runs forward)")
        return self.zero

    def destroy(self) -> None:
        """Release what the engine holds of torch.distributed, as DeepSpeed's ``engine.destroy``.

        Waits for in-flight parameter gathers and a pending asynchronous checkpoint save, then
        drops the engine's private checkpoint group (a later save or load builds a new one), so
        that ``destroy_process_group()`` really frees every group. Called at exit for every live
        engine; safe to call more than once.

        collective: call on all ranks, after the last training step.
        """
        self.zero.synchronize()
        self.wait_for_checkpoint()
        self.monitor.flush()
        self._checkpointer = None
        if self._python_gc is not None:
            PYTHON_GC.release(self._python_gc)
            self._python_gc = None

    def collect_python_gc(self) -> int:
        """One full Python garbage collection now (DeepSpeed's, for ``disable_python_gc``: at a
        moment the script picks, the same on every rank); returns the objects it found."""
        return PYTHON_GC.collect()

    def compile(self, backend: str | None = None, compile_kwargs: dict | None = None,
                schedule: Any = None, compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` the wrapped module in place, as DeepSpeed's ``engine.compile``.

        ``backend`` defaults to ``get_accelerator().get_compile_backend()`` (inductor);
        ``compile_kwargs`` go to ``torch.compile`` (a ``backend`` there is overridden). A second
        call is a no-op. ``schedule`` (DeepCompile) must be None.

        Raises:
            UsageError: a DeepCompile ``schedule`` or ``compiled_autograd_enabled`` was asked for.
        """
        if schedule is not None or compiled_autograd_enabled:
            raise UsageError("engine.compile(): DeepCompile schedules and compiled autograd are not "
                             "supported by dslaunch; call engine.compile(backend=..., compile_kwargs=...)")
        if self.is_compiled:
            return
        from dslaunch.runtime.accelerator import get_accelerator

        kwargs = {k: v for k, v in (compile_kwargs or {}).items() if k != "backend"}
        self.module.compile(backend=backend or get_accelerator().get_compile_backend(), **kwargs)
        self.is_compiled = True

    def was_step_applied(self) -> bool:
        return self._step_applied

    def report_tokens(self, n: int) -> None:
        """Tell the engine how many tokens this rank's micro step trained on (dslaunch's; call it in
        each micro step, before ``step()``). For loops whose forward gets no token ids (embeddings
        made outside the engine, packed float inputs, a custom batch object): tokens/s and MFU on
        the heartbeat, the status line and the monitors then use it instead of the automatic count
        (the first integer input of 2+ dims) for that step. A no-op when nothing reports rates.

        Raises:
            UsageError: ``n`` is not an int >= 0.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise UsageError(f"engine.report_tokens({quote(n)}): expected the number of tokens, an int >= 0")
        if self._work is not None:
            self._work.report_tokens(n)

    # ----- DeepSpeed's public getters -------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last boundary step, before clipping.

        Computed as DeepSpeed does at ZeRO stages 1/2 and for fp16/bf16 models, and also with
        ``gradient_clipping`` (DeepSpeed returns None for fp32 stage 0 even then). None for an
        fp32 stage 0 step without clipping, and before the first step.
        """
        return self._grad_norm

    # ----- module weights, as DeepSpeed's nn.Module engine ---------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict:  # type: ignore[override]
        """The module weights under a ``module.`` prefix (``nn.Module.state_dict`` of the engine)."""
        self.zero.synchronize()  # parameter gathers still in flight would be read half-written
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load ``module.``-prefixed weights into the module (and its fp32 masters).

        Unlike DeepSpeed, 16-bit models' fp32 master weights are refreshed too, so the loaded
        weights survive the next step; at stage 3 each rank stores its part of the whole values
        (every rank passes the same dict). Returns torch's ``(missing_keys, unexpected_keys)``.

        Raises:
            UsageError: ``assign=True`` (the parameters are views into ZeRO's flat buffers).
        """
        if assign:
            raise UsageError("engine.load_state_dict(assign=True) is not supported: the parameters "
                             "are views into ZeRO's flat buffers; use assign=False")
        from dslaunch.runtime.zero.full_state import load_module_state_dict

        self.zero.synchronize()
        result = load_module_state_dict(self, state_dict, strict, super().load_state_dict)  # stage 3: shards
        self.zero.sync_master_from_model()
        return result


def _set_parallelism(module: torch.nn.Module, config: DeepSpeedConfig) -> None:
    """Let every submodule that asks (DeepSpeed's MoE layers: ``set_deepspeed_parallelism``) make
    its expert groups before ZeRO places their parameters, as DeepSpeed's engine does; number the
    MoE layers (``moe_layer_id``) and tell them ``layout_invariant``.

    collective: every rank (the layers create process groups).
    """
    from dslaunch.runtime.moe.layer import MOELayer, number_moe_layers

    for sub in module.modules():
        setter = getattr(sub, "set_deepspeed_parallelism", None)
        if callable(setter):
            setter(config.use_data_before_expert_parallelism)
    number_moe_layers(module)
    for sub in module.modules():
        if isinstance(sub, MOELayer):
            sub.set_layout_invariant(config.layout_invariant.enabled)
