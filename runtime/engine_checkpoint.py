"""``DeepSpeedEngine``'s checkpoint methods: save and load (``dslaunch.runtime.checkpoint`` does the
work), the 16-bit model export, DeepSpeed's checkpoint file names, and the engine's own state
(counters, loss scaler, LR scheduler, data position) that a checkpoint holds.

A mixin of ``runtime.engine.DeepSpeedEngine`` only: it reads the engine's attributes (``zero``,
``module``, ``grid``, ``_config``, ...), so these DeepSpeed methods stay on the engine while its
training loop stays short.
"""

from __future__ import annotations

import contextlib
from typing import Any

from dslaunch.runtime.parallel.mpu import holds_model_parts

__all__ = ["EngineCheckpoints"]


class EngineCheckpoints:
    """Checkpoint methods of ``DeepSpeedEngine`` (see the module docstring)."""

    # ----- checkpoints (dslaunch.runtime.checkpoint) ---------------------------------------------
    def checkpoint_parts(self) -> Any:
        """The named parts a checkpoint of this engine holds (``checkpoint.parts.CheckpointParts``).

        collective on the first call (it builds the engine's checkpoint group): all ranks.
        """
        from dslaunch.runtime.checkpoint.checkpointer import Checkpointer
        from dslaunch.runtime.checkpoint.model_parallel import placement
        from dslaunch.runtime.checkpoint.parts import CheckpointParts, StateFns
        from dslaunch.runtime.zero.optimizer_view import BF16_Optimizer

        if self._checkpointer is None:
            self._checkpointer = Checkpointer()
        # every rank of a replica holds another part: files named by topology coordinates
        place = placement(self.grid, self.module) if self.mpu is not None and holds_model_parts(self.grid) else None
        return CheckpointParts(module=self.module, zero=self.zero,
                               training=StateFns(self.engine_state_dict, self.load_engine_state_dict),
                               optimizer=self.basic_optimizer, global_steps=self.global_steps,
                               config=self._config.checkpoint, io=self._checkpointer, placement=place,
                               ds_config=self.config, gradient_clipping=self._config.gradient_clipping,
                               bf16=self._config.bf16.enabled,
                               bf16_optimizer=isinstance(self.optimizer, BF16_Optimizer))

    def wait_for_checkpoint(self) -> None:
        """Block until a pending asynchronous save is durable; raise its error if it failed."""
        # No import here: destroy() runs at exit, where a first import can reset CPython's note of
        # an uncaught KeyboardInterrupt (the exit code would be 1 instead of 130).
        if self._checkpointer is not None:
            self._checkpointer.writer.wait()

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> Any:
        from dslaunch.runtime import checkpoint

        # The monitors' events up to this step reach their files before the checkpoint does: a run
        # killed later and resumed from it continues a curve with no hole before the resume point.
        self.monitor.flush()
        with self._checkpoint_phase():
            self.zero.synchronize()
            return checkpoint.save_checkpoint(self.checkpoint_parts(), save_dir, tag=tag, client_state=client_state,
                                              save_latest=save_latest,
                                              exclude_frozen_parameters=exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[Any, Any]:
        from dslaunch.runtime import checkpoint

        with self._checkpoint_phase():
            self.zero.synchronize()
            return checkpoint.load_checkpoint(self.checkpoint_parts(), load_dir, tag=tag,
                                              load_module_strict=load_module_strict,
                                              load_optimizer_states=load_optimizer_states,
                                              load_lr_scheduler_states=load_lr_scheduler_states,
                                              load_module_only=load_module_only)

    # DeepSpeed's file names in its own layout (``checkpoint/deepspeed_layout.py``): files of a
    # checkpoint DeepSpeed wrote, or dslaunch with checkpoint.format "deepspeed" (never its own layout).
    def _get_ckpt_name(self, checkpoints_path: str, tag: Any, mp_placeholder: str | None = None,
                       pp_placeholder: str | None = None) -> str:
        from dslaunch.runtime.checkpoint.deepspeed_layout import ckpt_name

        mp = mp_placeholder if mp_placeholder is not None else f"{self.grid.get_model_parallel_rank():02d}"
        dp = pp_placeholder if pp_placeholder is not None else self.grid.get_data_parallel_rank()
        return ckpt_name(checkpoints_path, tag, self.zero.stage == 3, dp, mp)

    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: Any) -> str:
        from dslaunch.runtime.checkpoint.deepspeed_layout import zero_ckpt_name

        return zero_ckpt_name(checkpoints_path, tag, self.grid.get_data_parallel_rank(), self.bfloat16_enabled(),
                              self.grid.get_model_parallel_rank())

    def _get_optimizer_ckpt_name(self, checkpoints_path: str, tag: Any, expp_rank: int) -> str:
        from dslaunch.runtime.checkpoint.deepspeed_layout import optimizer_ckpt_name

        return optimizer_ckpt_name(checkpoints_path, tag, expp_rank, self.grid.get_model_parallel_rank())

    @staticmethod
    def _get_expert_ckpt_name(checkpoints_path: str, layer_id: int, expert_id: int, tag: Any, mpu: Any = None,
                              checkpoint_mp_rank: int | None = None) -> str:
        from dslaunch.runtime.checkpoint.deepspeed_experts import expert_ckpt_name

        return expert_ckpt_name(checkpoints_path, layer_id, expert_id, tag, mpu, checkpoint_mp_rank)

    @staticmethod
    def load_moe_state_dict(checkpoint_path: str, tag: Any, state_dict: dict, old_moe_load: bool, model: Any = None,
                            mpu: Any = None, num_experts: Any = 1, checkpoint_engine: Any = None,
                            autoep_layers: Any = None, folding_spec: Any = None,
                            checkpoint_mp_rank: int | None = None) -> None:
        """DeepSpeed's: ``state_dict`` filled with this rank's experts from a DeepSpeed-layout tag's
        expert files (``deepspeed_experts.load_moe_state_dict``)."""
        from dslaunch.runtime.checkpoint.deepspeed_experts import load_moe_state_dict

        load_moe_state_dict(checkpoint_path, tag, state_dict, old_moe_load, model, mpu, autoep_layers, folding_spec,
                            checkpoint_mp_rank)

    def _checkpoint_phase(self) -> contextlib.AbstractContextManager:
        """Saving or loading is not a training step: the monitor's hang rule allows it longer."""
        return self._heartbeat.phase("checkpoint") if self._heartbeat is not None else contextlib.nullcontext()

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> Any:
        """DeepSpeed's older name of ``save_16bit_model`` (kept by DeepSpeed for old scripts)."""
        return self.save_16bit_model(save_dir, save_filename)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> Any:
        """Rank 0 writes the whole module state dict (model dtype). With partitioned parameters
        (stage 3) only if ``stage3_gather_16bit_weights_on_model_save`` (else False, as DeepSpeed).

        collective: call on all ranks.
        """
        from dslaunch.runtime import checkpoint
        from dslaunch.runtime.zero.params import is_partitioned

        if (not self._config.zero_optimization.stage3_gather_16bit_weights_on_model_save
                and any(is_partitioned(p) for p in self.module.parameters())):
            if self.global_rank == 0:
                print("dslaunch: warning: save_16bit_model() saved nothing: the parameters are "
                      "partitioned; set zero_optimization.stage3_gather_16bit_weights_on_model_save "
                      "to true (or use zero_to_fp32)", flush=True)
            return False
        with self._checkpoint_phase():
            self.zero.synchronize()
            # ZeRO-3 with AutoTP: the tensor slices joined too, as DeepSpeed's (its stage-3 export)
            # {} on the other ranks: None would have save_16bit_model gather (collectively) on them alone
            whole = ((self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters) or {})
                     if self.zero.stage == 3 and self._config.tensor_parallel.size > 1 else None)
            return checkpoint.save_16bit_model(self.checkpoint_parts(), save_dir, save_filename=save_filename,
                                               exclude_frozen_parameters=exclude_frozen_parameters,
                                               state_dict=whole)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """The whole module state dict (model dtype) on rank 0 (None elsewhere, which accelerate's
        ``save_model`` tests for), as DeepSpeed's;
        with AutoTP each parameter's tensor slices are joined too (DeepSpeed 0.19.4+).

        collective: call on all ranks (partitioned parameters are gathered module by module).
        """
        from dslaunch.runtime.moe.autoep_state import unconverted_state_dict
        from dslaunch.runtime.zero.full_state import module_state_dict

        self.zero.synchronize()
        sd = unconverted_state_dict(self.module, module_state_dict(self.module, exclude_frozen_parameters))
        if self._config.tensor_parallel.size > 1:
            from dslaunch.runtime.parallel.mpu import tensor_axis
            from dslaunch.runtime.tensor_parallel.consolidate import whole_state_dict

            sd = whole_state_dict(self.module, tensor_axis(self.grid, "group"), sd)
        return sd if self.global_rank == 0 else None

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """DeepSpeed's: the whole module state dict when the weights are split, on rank 0 (None
        elsewhere under AutoTP; ZeRO-3's answer as ``_zero3_consolidated_16bit_state_dict``).

        Raises:
            ValueError: neither ZeRO-3 nor AutoTP splits the weights (DeepSpeed's refusal).

        collective: call on all ranks.
        """
        if self.zero.stage == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self._config.tensor_parallel.size <= 1:
            raise ValueError("_consolidated_16bit_state_dict applies where the weights are split (ZeRO stage 3 or "
                             "tensor_parallel.autotp_size > 1); use engine.module_state_dict()")
        from dslaunch.runtime.parallel.mpu import tensor_axis
        from dslaunch.runtime.tensor_parallel.consolidate import whole_state_dict

        self.zero.synchronize()
        sd = whole_state_dict(self.module, tensor_axis(self.grid, "group"))
        if exclude_frozen_parameters:
            self._drop_frozen(sd)
        return sd if self.global_rank == 0 else None

    def module_state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        """The wrapped module's state dict (no ``module.`` prefix), as DeepSpeed's.

        ``exclude_frozen_parameters`` drops parameters with ``requires_grad=False``.
        """
        self.zero.synchronize()
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            self._drop_frozen(sd, prefix)
        return sd

    def _drop_frozen(self, sd: dict, prefix: str = "") -> None:
        """Remove the module's parameters with ``requires_grad=False`` from ``sd`` (keys under ``prefix``)."""
        for key in {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad} & set(sd):
            del sd[key]

    # ----- engine state (everything but weights, ZeRO state and RNG) --------------------------
    def engine_state_dict(self) -> dict:
        """Counters, loss scaler, LR scheduler, data position (see the checkpoint contract) and the
        gradient exchange's state (a 1-bit optimizer's error feedback: this rank's own)."""
        exchange = getattr(self.zero, "exchange", None)  # none without an optimizer
        return {"grad_exchange": exchange.state_dict() if exchange is not None else None,
                "global_steps": self.global_steps, "global_samples": self.global_samples,
                "micro_steps": self.micro_steps, "skipped_steps": self.skipped_steps,
                "loss_scaler": self.loss_scaler.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                "dataloader": (self.training_dataloader.state_dict()
                               if self.training_dataloader is not None else None),
                "random_ltd": self.random_ltd_scheduler.state_dict() if self.random_ltd_scheduler else None}

    def load_engine_state_dict(self, sd: dict) -> None:
        """Restore what ``engine_state_dict`` returned."""
        for key in ("global_steps", "global_samples", "micro_steps", "skipped_steps"):
            setattr(self, key, int(sd[key]))
        self._compression.resume(self.global_steps - self.skipped_steps)  # its count of applied steps
        exchange = getattr(self.zero, "exchange", None)
        if exchange is not None:  # None saved (older checkpoints, load_optimizer_states=False): fresh
            exchange.load_state_dict(sd.get("grad_exchange"))
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        for part, key in ((self.lr_scheduler, "lr_scheduler"), (self.training_dataloader, "dataloader"),
                          (self.random_ltd_scheduler, "random_ltd")):
            if part is not None and sd.get(key) is not None:
                part.load_state_dict(sd[key])
