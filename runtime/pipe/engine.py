"""The pipeline engine (DeepSpeed's ``deepspeed.runtime.pipe.engine.PipelineEngine``).

``initialize`` builds it when the model is a ``PipelineModule``; its mpu is the module's
``PipelineParallelGrid``, so the data loader, ZeRO and the batch size come from the data axis and
the gradient norm (clip factor, fp16 overflow skip) is agreed over the whole replica, as for any
engine given that grid (``DeepSpeedEngine``).

``train_batch()`` runs one optimizer step as a schedule (``runtime/pipe/schedule.py``): DeepSpeed's
time steps of instructions per stage, executed one by one by ``_INSTRUCTION_MAP`` in
``schedule.execution_order`` (each step's sends first: they never block). The ZeRO strategy sees each
micro batch's backward as one micro step of the accumulation (the last one is the boundary), so
stages 0-2, offload and the loss scaler work unchanged. Where a message goes is the module's
placement's (``placement.py``: round-robin, or DualPipeV's V, whose last rank hands a part's outputs
to its own next part without one). The engine's ``events`` get a forward and a
backward phase per micro batch and one ``StepRecord`` per ``train_batch``; every ``steps_per_print``
steps rank 0 prints DeepSpeed's ``steps: N loss: X iter time (s): T samples/sec: S`` line.

Checkpoints hold each rank's part, named by its coordinates, with one file per layer
(``runtime/checkpoint/model_parallel.py``); they load at another pipeline shape.

Limitations: ZeRO-3 is refused (a one-line ``ConfigError``); tied layers need ZeRO stage 0 or 1.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import PipelineStageError, UsageError
from dslaunch.runtime import heartbeat
from dslaunch.runtime.activation_checkpointing import checkpointing
from dslaunch.runtime.comm import comm
from dslaunch.runtime.config import DeepSpeedConfig
from dslaunch.runtime.dataloader import RepeatingLoader
from dslaunch.runtime.engine import DeepSpeedEngine
from dslaunch.runtime.engine_setup import data_loader
from dslaunch.runtime.heartbeat import waiting
from dslaunch.runtime.pipe import p2p
from dslaunch.runtime.pipe import schedule as sched
from dslaunch.runtime.pipe.checks import check_config, check_round_robin
from dslaunch.runtime.pipe.data import as_received, as_tuple, concat, input_grads, scalar_loss, to_device
from dslaunch.runtime.pipe.module import PipelineModule
from dslaunch.runtime.pipe.placement import Placement
from dslaunch.runtime.timers import Timer

__all__ = ["PipelineEngine"]

# Message tags: with virtual stages (and DualPipeV) one direction between two ranks carries both kinds.
_TAGS = {sched.SendActivation: 1, sched.RecvActivation: 1, sched.SendGrad: 2, sched.RecvGrad: 2}
_ONLY_TRAIN_BATCH = "is not available with pipeline parallelism: use engine.train_batch() (and eval_batch())"


@dataclass
class _Batch:
    """What one ``train_batch``/``eval_batch`` holds per micro batch until its backward is done."""

    micro_batches: int
    train: bool
    inputs: dict[int, Any] = field(default_factory=dict)
    labels: dict[int, Any] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)
    grads: dict[int, Any] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    compute_loss: bool = True
    keep_logits: bool = False
    sends: list[p2p.PendingSend] = field(default_factory=list)
    receivers: dict[type, p2p.Receiver] = field(default_factory=dict)
    """Per receive instruction type, its messages of the batch, posted ahead."""
    backwards_left: int = 0
    """Backward passes still to run; the last one is the accumulation boundary."""
    reduced: bool = False
    """The boundary's data-parallel reduction is complete (``_finish_reduction``)."""


@dataclass(frozen=True)
class _Activity:
    """An instruction as the heartbeat tells it (formatted only when a beat goes out)."""

    stage: int
    placement: Placement
    instruction: sched.PipeInstruction

    def __str__(self) -> str:
        return self.instruction.describe(self.stage, self.placement.stages, self.placement)


class PipelineEngine(DeepSpeedEngine):
    """Trains a ``PipelineModule``: each rank runs its stage of every micro batch.

    Use ``loss = engine.train_batch()`` (or ``train_batch(data_iter)``) once per optimizer step;
    ``forward``, ``backward`` and ``step`` raise ``UsageError`` as in DeepSpeed.

    collective: construct, ``train_batch`` and ``eval_batch`` on all ranks.

    Raises:
        ConfigError: ZeRO stage 3, ``pipeline.stages`` other than the module's, or tied layers with
            ZeRO stage 2.
    """

    pipeline_parallelism = True  # DeepSpeed's attribute

    def __init__(self, model: PipelineModule, config: DeepSpeedConfig, **kwargs: Any):
        check_config(model, config)
        self._check_schedule(model, config)
        training_data = kwargs.pop("training_data", None)
        super().__init__(model, config, mpu=model.mpu(), **kwargs)
        if training_data is not None:
            # In order, as DeepSpeed's pipeline reads it (its sampler does not shuffle): a micro
            # batch holds neighbouring samples, which a dataset may make alike in shape.
            self.training_dataloader = data_loader(config, training_data, self.grid, collate_fn=kwargs.get("collate_fn"),
                                                   shuffle=False)
        self.num_stages, self.stage_id = model.num_stages, model.stage_id
        self.micro_batches = config.gradient_accumulation_steps
        if model.activation_checkpoint_interval == 0:
            model.activation_checkpoint_interval = config.pipeline.activation_checkpoint_interval
        if not config.pipeline.use_reentrant:
            model.activation_checkpoint_func = checkpointing.non_reentrant_checkpoint
        self.placement = model.placement
        self.chunks = self.placement.chunks
        held = [self.placement.part(self.stage_id, c) for c in range(self.chunks)]
        # this rank's chunk that reads the inputs (the model's first part), and the one with the loss
        self._input_chunk = held.index(0) if 0 in held else None
        self._label_chunk = held.index(self.placement.num_parts - 1) if self.placement.num_parts - 1 in held else None
        self.data_iterator: Iterator | None = None
        self.batch_fn: Callable | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self._out_of_step: str | None = None
        """Set when a batch raised mid-schedule: what happened (``_refuse_out_of_step``)."""
        self._stops: list[p2p.PendingSend] = []
        """The stops sent for the messages of that batch (kept alive until they land)."""
        self._batch_timer = Timer("train_batch")
        """``train_batch``'s time since the last per-step line (``_print_batch_line``)."""
        if self.training_dataloader is not None and (self.is_first_stage() or self.is_last_stage()):
            self.set_dataiterator(RepeatingLoader(self.training_dataloader))

    # ----- DeepSpeed's pipeline API -----------------------------------------------------------
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """Whether this rank computes the loss (it holds the model's last part)."""
        return self._label_chunk is not None

    def _loss_stage_global_rank(self) -> int:
        """DeepSpeed's name: the global rank, in this replica, of the stage computing the loss."""
        return self.grid.stage_to_global(self.placement.owner(self.placement.num_parts - 1)[0])

    @staticmethod
    def _check_schedule(model: PipelineModule, config: DeepSpeedConfig) -> None:
        check_round_robin(model, config)

    def _train_schedule(self) -> sched.PipeSchedule:
        return sched.SCHEDULES[self._config.pipeline.schedule](self.micro_batches, self.num_stages, self.stage_id,
                                                                self.chunks)

    def _inference_schedule(self, micro_batches: int) -> sched.PipeSchedule:
        return sched.InferenceSchedule(micro_batches, self.num_stages, self.stage_id, self.chunks)

    def _reentrant_activation_checkpointing(self) -> bool:
        """Whether this stage checkpoints with the reentrant ``deepspeed.checkpointing.checkpoint``
        (DeepSpeed then makes the first stage's inputs require grad; dslaunch's reentrant
        checkpoint anchors its outputs in the graph itself, so nothing else changes)."""
        return self.module.activation_checkpoint_interval > 0 and \
            self.module.activation_checkpoint_func is checkpointing.checkpoint

    def set_dataiterator(self, iterator: Iterator) -> None:
        """Where ``train_batch()``/``eval_batch()`` without an iterator read micro batches from."""
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable) -> None:
        """``fn(batch) -> (inputs, labels)`` applied to every micro batch read."""
        self.batch_fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise UsageError(f"engine.forward() {_ONLY_TRAIN_BATCH}")

    def backward(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise UsageError(f"engine.backward() {_ONLY_TRAIN_BATCH}")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise UsageError(f"engine.step() {_ONLY_TRAIN_BATCH}")

    def _use_batch(self, config: DeepSpeedConfig) -> None:
        """A new batch triad (``set_train_batch_size``): ``train_batch`` runs its accumulation steps
        as micro batches, checked against this pipeline as the config was (the interleaved schedule)."""
        check_config(self.module, config)
        self._check_schedule(self.module, config)
        super()._use_batch(config)
        self.micro_batches = config.gradient_accumulation_steps

    def train_batch(self, data_iter: Iterator | None = None) -> torch.Tensor:
        """Pull ``gradient_accumulation_steps`` micro batches, train on them, take one step.

        Returns the mean loss of the micro batches (averaged over the data-parallel replicas),
        on every stage.

        collective: call on all ranks.

        Raises:
            UsageError: called under ``torch.no_grad()``, no data iterator on a stage that reads data,
                or an earlier batch raised mid-schedule on this rank (the stages are out of step).
        """
        if not torch.is_grad_enabled():
            raise UsageError("train_batch() was called under torch.no_grad(); use eval_batch() to evaluate")
        self._refuse_out_of_step("train_batch")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        if self.curriculum_scheduler_legacy is not None:
            # as DeepSpeed's: the stages read the difficulty themselves (nothing is passed to a
            # stage's forward); every message carries its shapes, so a new seqlen needs no reset
            self.curriculum_scheduler_legacy.update_difficulty(self.global_steps + 1)
            self.curriculum_scheduler_legacy.first_step = False
        self.zero.pre_forward()
        batch = _Batch(self.micro_batches, train=True)
        self._batch_timer.start()
        try:
            self._execute(self._train_schedule(), batch)
        finally:
            self._batch_timer.stop()
        self._print_batch_line()
        return self.agg_train_loss

    def _print_batch_line(self) -> None:
        """DeepSpeed's per-step line: every ``steps_per_print`` steps, global rank 0 prints the
        batch's loss (its micro batches' mean, averaged over the replicas: ``agg_train_loss``),
        the mean ``train_batch`` time since the last line and ``train_batch_size`` over it."""
        every = self._config.steps_per_print
        if not every or self.global_steps % every:
            return
        batches = self._batch_timer.count  # DeepSpeed divides by steps_per_print: wrong after a resume
        seconds = self._batch_timer.elapsed(reset=True) / max(1, batches)
        if self.global_rank != 0:
            return
        rate = f"{self.train_batch_size() / seconds:0.3f}" if seconds > 0 else "n/a"
        print(f"steps: {self.global_steps} loss: {float(self.agg_train_loss):0.4f} iter time (s): {seconds:0.3f} "
              f"samples/sec: {rate}", flush=True)

    def eval_batch(self, data_iter: Iterator, return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str | None = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> Any:
        """Forward ``num_micro_batches`` (default: the accumulation steps) micro batches, no step.

        Returns the loss averaged over micro batches and replicas (``reduce_output="avg"``), or the
        list of per-micro-batch losses (None); with ``compute_loss=False`` the model's outputs
        instead. ``bcast_loss`` broadcasts an averaged loss to every stage (else the other stages
        return None). ``return_logits``: ``(loss, logits)``, the last stage's outputs of every
        micro batch concatenated along dimension 0 (None elsewhere).

        collective: call on all ranks.
        """
        if reduce_output not in ("avg", None):
            raise UsageError(f"eval_batch(reduce_output={reduce_output!r}): use 'avg' or None")
        self._refuse_out_of_step("eval_batch")
        self.set_dataiterator(data_iter)
        micro = self.micro_batches if num_micro_batches is None else int(num_micro_batches)
        batch = _Batch(micro, train=False, compute_loss=compute_loss, keep_logits=return_logits)
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                self.zero.pre_forward()
                self._execute(self._inference_schedule(micro), batch)
                self._wait_sends(batch)
                result = self._eval_result(batch, reduce_output, bcast_loss)
        finally:
            self.module.train(was_training)
        if not return_logits:
            return result
        logits = concat(batch.logits) if self.is_last_stage() else None
        return result, logits

    # ----- the instructions -------------------------------------------------------------------
    def _execute(self, schedule: sched.PipeSchedule, batch: _Batch) -> None:
        batch.backwards_left = schedule.micro_batches * schedule.chunks
        instructions = sched.execution_order(schedule)
        # one queue per kind and sender (DualPipeV's ranks receive activations from both sides)
        counts = Counter((type(i), self._peer(i)) for i in instructions if isinstance(i, sched.RecvActivation
                                                                                      | sched.RecvGrad))
        for (kind, src), count in counts.items():
            batch.receivers[(kind, src)] = p2p.Receiver(src, count, tag=_TAGS[kind])
        report = heartbeat.reporter()  # each instruction is published: a hang report names what a stage waits for
        try:
            for done, instruction in enumerate(instructions):  # noqa: B007 - where it stopped, below
                if report is not None:
                    report.set_activity(_Activity(self.stage_id, self.placement, instruction))
                self._INSTRUCTION_MAP[type(instruction)](self, instruction, batch)
        except BaseException as err:
            if report is not None and isinstance(err, Exception) and not isinstance(err, PipelineStageError):
                report.raised(err)  # first: the stops below make the other stages raise too
            if self.num_stages > 1:  # the other stages are still in this batch; its heads stay posted
                self._stop_batch(instructions[done:], err)
            raise
        finally:
            if report is not None:
                report.set_activity(None)  # between batches the script's own code runs

    def _stop_batch(self, left: list[sched.PipeInstruction], err: BaseException) -> None:
        """``err`` stopped this rank's batch at ``left[0]``: remember why (``_refuse_out_of_step``) and
        send a stop in place of each message ``left`` would have sent, so the stages waiting for them
        raise ``PipelineStageError`` (and stop theirs in turn) instead of waiting for this process
        to exit. The stops go out unwaited: the peers posted their heads at the batch's start."""
        if isinstance(err, PipelineStageError):
            self._out_of_step = err.reason  # the first stage that failed, passed on
        else:
            first = (str(err).strip().splitlines() or [""])[0]
            self._out_of_step = (f"{left[0].describe(self.stage_id, self.num_stages, self.placement)}: {type(err).__name__}"
                                 + (f": {first}" if first else ""))
        try:
            for instruction in left:
                if type(instruction) in (sched.SendActivation, sched.SendGrad):
                    self._stops.append(p2p.send_stop(self._out_of_step, self._peer(instruction),
                                                     tag=_TAGS[type(instruction)]))
        except Exception:  # noqa: BLE001 - a peer already gone: the error being raised says more
            pass

    def _refuse_out_of_step(self, call: str) -> None:
        """A batch that raised mid-schedule leaves this rank's receives of it posted (a message of
        that batch would land in the next one's place) and the other stages waiting in it: no
        batch can follow on any stage, only a restart."""
        if self._out_of_step is not None:
            raise UsageError(f"{call}() cannot run: an earlier batch failed ({self._out_of_step}) and its "
                             "messages between the stages are half exchanged; restart the job (or resume "
                             "from the last checkpoint)")

    def _peer(self, ins: sched.PipeInstruction) -> int:
        """The global rank a message instruction sends to or receives from: activations go to the
        next part's holder, gradients to the previous one's."""
        step = 1 if isinstance(ins, sched.SendActivation | sched.RecvGrad) else -1
        return self.grid.stage_to_global(self.placement.neighbour(self.stage_id, ins.chunk, step)[0])

    def _local_next(self, chunk: int) -> int | None:
        """This rank's chunk holding the part after ``chunk``'s (DualPipeV's turn on its last rank):
        the outputs pass to it without a message."""
        nxt = self.placement.neighbour(self.stage_id, chunk, 1)
        return nxt[1] if nxt is not None and nxt[0] == self.stage_id else None

    def _exec_load_micro_batch(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        if self.data_iterator is None:
            raise UsageError(f"stage {self.stage_id} reads data but has no data iterator: pass data_iter to "
                             "train_batch()/eval_batch(), or training_data to initialize()")
        data = next(self.data_iterator)
        if self.batch_fn is not None:
            data = self.batch_fn(data)
        if not isinstance(data, tuple | list) or len(data) != 2:
            raise UsageError("a pipeline micro batch must be (inputs, labels); use set_batch_fn() to convert "
                             f"yours (got {type(data).__name__})")
        if self._input_chunk is not None:  # floating inputs in the model's dtype (fp16/bf16), as the weights
            batch.inputs[(ins.micro_batch, self._input_chunk)] = to_device(data[0], self.device,
                                                                           self.precision.model_dtype)
        if self._label_chunk is not None:
            batch.labels[(ins.micro_batch, self._label_chunk)] = to_device(data[1], self.device)

    def _exec_forward_pass(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        key, last = (ins.micro_batch, ins.chunk), ins.chunk == self._label_chunk
        with self.events.phase("forward"):
            with self._autocast():  # the first stage's inputs are in the model dtype already (fp16.auto_cast's cast)
                out = self.module(batch.inputs[key], chunk=ins.chunk)
            if last:
                if batch.keep_logits:
                    batch.logits.append(out)
                if batch.compute_loss and self.module.loss_fn is not None:
                    out = self.module.loss_fn(out, batch.labels.pop(key))
                batch.losses.append(scalar_loss(out) if batch.train else out)
        local = self._local_next(ins.chunk)
        if local is not None:
            batch.inputs[(ins.micro_batch, local)] = as_received(out)
        if batch.train or not (last or local is not None):
            batch.outputs[key] = out
        if not batch.train:
            batch.inputs.pop(key)

    def _exec_send_activations(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        key = (ins.micro_batch, ins.chunk)
        out = batch.outputs[key] if batch.train else batch.outputs.pop(key)
        batch.sends.append(p2p.send(out, self._peer(ins), what=f"stage {self.stage_id}'s output",
                                    tag=_TAGS[type(ins)]))

    def _exec_recv_activations(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        batch.inputs[(ins.micro_batch, ins.chunk)] = batch.receivers[(type(ins), self._peer(ins))].recv(self.device)

    def _exec_recv_grads(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        batch.grads[(ins.micro_batch, ins.chunk)] = batch.receivers[(type(ins), self._peer(ins))].recv(self.device)

    def _exec_backward_pass(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        batch.backwards_left -= 1
        boundary = batch.backwards_left == 0
        self.zero.begin_micro_step(boundary)
        key = (ins.micro_batch, ins.chunk)
        out = batch.outputs.pop(key)
        with self.events.phase("backward"):
            if ins.chunk == self._label_chunk:
                self.loss_scaler.scale_loss(out / batch.micro_batches).backward()
            else:
                tensors = [t for t in as_tuple(out) if t.requires_grad]
                local = self._local_next(ins.chunk)
                grads = (input_grads(batch.inputs.pop((ins.micro_batch, local))) if local is not None
                         else as_tuple(batch.grads.pop(key)))
                if tensors:
                    torch.autograd.backward(tensors, grads)
        if not boundary:  # the boundary's reduction waits until this stage's last gradient is sent
            self._backward_epilogue()

    def _exec_send_grads(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        grads = input_grads(batch.inputs.pop((ins.micro_batch, ins.chunk)))
        batch.sends.append(p2p.send(grads, self._peer(ins), what=f"stage {self.stage_id}'s input gradients",
                                    tag=_TAGS[type(ins)]))

    def _exec_reduce_grads(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        self._finish_reduction(batch)

    def _exec_reduce_tied_grads(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        # DeepSpeed's schedule sums tied gradients first; here the data-parallel reduction must be
        # complete before (with overlap_comm its buckets may still be reducing the .grad the tie
        # sums in place). Both are sums, so the result is the same in either order.
        self._finish_reduction(batch)
        self.module.allreduce_tied_weight_gradients(self.zero.gradient_of)

    def _finish_reduction(self, batch: _Batch) -> None:
        """The boundary's data-parallel reduction, once per batch (collective over the data axis)."""
        if not batch.reduced:
            batch.reduced = True
            self._backward_epilogue()

    def _exec_optimizer_step(self, ins: sched.PipeInstruction, batch: _Batch) -> None:
        self._wait_sends(batch)
        local = torch.stack(batch.losses).mean() if self.is_last_stage() else None
        self.agg_train_loss = self._loss = self._mean_loss(local)
        self._window_losses = [self.agg_train_loss]  # the monitors log this window's mean: the batch's loss
        self.micro_steps += batch.micro_batches - 1  # the record counts micro steps before the last
        self._take_model_step()
        self.micro_steps += 1

    _INSTRUCTION_MAP: dict[type, Callable[[PipelineEngine, sched.PipeInstruction, _Batch], None]] = {
        sched.LoadMicroBatch: _exec_load_micro_batch,
        sched.ForwardPass: _exec_forward_pass,
        sched.SendActivation: _exec_send_activations,
        sched.RecvActivation: _exec_recv_activations,
        sched.RecvGrad: _exec_recv_grads,
        sched.BackwardPass: _exec_backward_pass,
        sched.SendGrad: _exec_send_grads,
        sched.ReduceGrads: _exec_reduce_grads,
        sched.ReduceTiedGrads: _exec_reduce_tied_grads,
        sched.OptimizerStep: _exec_optimizer_step,
        sched.CommitP2P: lambda self, ins, batch: None,  # sends go as they come, receives are posted ahead
    }

    # ----- losses -----------------------------------------------------------------------------
    @staticmethod
    def _wait_sends(batch: _Batch) -> None:
        for pending in batch.sends:
            pending.wait()
        batch.sends.clear()

    def _replica_mean(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` averaged over the data-parallel replicas (collective over the data axis)."""
        value = local.detach().float().clone()
        if self.dp_world_size > 1:
            comm.all_reduce(value, group=self.grid.get_data_parallel_group())
            value /= self.dp_world_size
        return value

    def _mean_loss(self, local: torch.Tensor | None, shape: tuple | None = ()) -> torch.Tensor:
        """The last stage's mean loss (or averaged outputs; ``shape`` None: not known to the other
        stages), averaged over the replicas, on every stage of the replica.

        collective: every rank (data-parallel all-reduce on the last stage, pipe broadcasts).
        """
        value = self._replica_mean(local) if self.is_last_stage() else None
        if self.num_stages == 1:
            return value
        group, src = self.grid.get_pipe_parallel_group(), self._loss_stage_global_rank()
        if shape is None:  # eval outputs: the other stages learn the shape first
            shapes = [tuple(value.shape) if value is not None else None]
            with waiting("pipeline broadcast of the eval output's shape"):
                dist.broadcast_object_list(shapes, src=src, group=group)
            shape = shapes[0]
        if value is None:
            value = torch.empty(shape, dtype=torch.float32, device=self.device)
        comm.broadcast(value, src=src, group=group)
        return value

    def _eval_result(self, batch: _Batch, reduce_output: str | None, bcast_loss: bool) -> Any:
        if reduce_output is None:
            return batch.losses if self.is_last_stage() else None
        local = torch.stack([x.detach().float() for x in batch.losses]).mean(0) if self.is_last_stage() else None
        if bcast_loss:
            return self._mean_loss(local, shape=None)
        return self._replica_mean(local) if local is not None else None
