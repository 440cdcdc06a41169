"""AutoSP's fusion adapters (``deepspeed.sequence.autosp_fusion``): the vision-language boundary
of a multimodal model under sequence parallelism.

The vision tower's output arrives split over the sequence group (each rank its patches); the
language model's input must be the fused sequence (text with the visual tokens spliced in) split
evenly. An adapter wraps the projector and, per call: projects this rank's visual tokens, gathers
every rank's (``gather.gather_sequence``: shards may differ in length), splices them into the
whole text embedding (the same on every rank), pads the fused sequence with zero rows to a
multiple of the group's size (at its end) and returns this rank's equal part.

The splice is the model's: ``LlavaFusionAdapter`` replaces each image placeholder token by its
visual tokens (the sequence grows), ``InternVLFusionAdapter`` each ``IMG_CONTEXT`` token by one
visual token, ``Qwen2VLFusionAdapter`` the tokens between each ``vision_start``/``vision_end``
pair one for one. ``ModalityFusionSPAdapter`` is the base to subclass (override
``_splice_visual_into_text``).

Gradients reach the projector and every rank's visual tokens (summed over the ranks by the
gather's backward); DeepSpeed 0.19.8's gather has no backward, so there the projector gets none.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from dslaunch.errors import UsageError
from dslaunch.runtime.sequence_parallel.batch import padded_length
from dslaunch.runtime.sequence_parallel.gather import gather_sequence

__all__ = ["ModalityFusionSPAdapter", "LlavaFusionAdapter", "InternVLFusionAdapter", "Qwen2VLFusionAdapter"]

_DEFAULT_IMAGE_TOKEN_ID = -200  # LLaVA's image placeholder (DeepSpeed's default)
_SEQ = 1


def _my_part(fused: torch.Tensor, group: Any) -> torch.Tensor:
    """This rank's equal part of ``fused`` (``[batch, sequence, hidden]``), zero rows appended to
    make the sequence a multiple of the group's size."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    length = fused.shape[_SEQ]
    part = padded_length(length, world) // world
    padded = F.pad(fused, (0, 0, 0, part * world - length))
    return padded[:, rank * part:(rank + 1) * part].contiguous()


class _FusionSP(torch.nn.Module):
    """Project, gather, splice, split: the adapters' shared ``forward``."""

    def __init__(self, projection: torch.nn.Module, process_group: Any) -> None:
        import torch.distributed as dist

        super().__init__()
        self.projection = projection
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)

    def forward(self, visual_features: torch.Tensor, text_embeds: torch.Tensor,
                input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's part of the fused embedding.

        Args:
            visual_features: this rank's visual tokens, ``[batch, local_visual, vision_hidden]``.
            text_embeds: the whole text embedding, ``[batch, text_length, hidden]`` (every rank).
            input_ids: the whole text, ``[batch, text_length]`` (every rank), locating the
                placeholders.

        Returns:
            ``[batch, ceil(fused_length / world), hidden]``: rank ``r``'s part of the fused
            sequence, zero-padded at its end.

        collective: every rank of ``process_group``, forward and backward.
        """
        if input_ids.shape != text_embeds.shape[:2]:
            raise UsageError(f"{type(self).__name__}: input_ids {tuple(input_ids.shape)} must match text_embeds "
                             f"{tuple(text_embeds.shape)} in batch and sequence length")
        visual = self.projection(visual_features)
        full_visual, _ = gather_sequence(visual, _SEQ, self.process_group, f"{type(self).__name__} visual tokens")
        return _my_part(self._splice_visual_into_text(text_embeds, full_visual, input_ids), self.process_group)

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _too_few(adapter: torch.nn.Module, sample: int, needed: int, have: int, what: str) -> UsageError:
    return UsageError(f"{type(adapter).__name__}: sample {sample} of input_ids has {needed} {what} but the gathered "
                      f"visual features have {have} tokens, too few to give each its visual tokens")


class ModalityFusionSPAdapter(_FusionSP):
    """The fusion adapter base: subclass it and override ``_splice_visual_into_text`` for a model.

    Args:
        projection: the vision-language projector (``mm_projector``).
        process_group: the sequence-parallel group.
        image_token_id: the image placeholder token of ``input_ids`` (LLaVA's -200 by default).

    Raises (from ``forward``, on this class itself): NotImplementedError naming the method to
    override, as DeepSpeed's base does (it has no splice of its own).
    """

    def __init__(self, projection: torch.nn.Module, process_group: Any,
                 image_token_id: int = _DEFAULT_IMAGE_TOKEN_ID) -> None:
        super().__init__(projection, process_group)
        self.image_token_id = image_token_id

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        """``text_embeds`` with the image placeholders replaced by ``visual_embeds``: the model's
        own rule (``LlavaFusionAdapter``, ``InternVLFusionAdapter``), or yours in a subclass."""
        raise NotImplementedError(f"{type(self).__name__}._splice_visual_into_text: ModalityFusionSPAdapter has no "
                                  "splice of its own; use LlavaFusionAdapter, InternVLFusionAdapter or "
                                  "Qwen2VLFusionAdapter, or subclass it and override this method")


class LlavaFusionAdapter(ModalityFusionSPAdapter):
    """LLaVA: each image placeholder token becomes that image's visual tokens (the sequence grows).

    A sample's visual tokens are divided between its placeholders in order as ``torch.chunk``
    does (one image per placeholder, images of equal size); samples without a placeholder keep
    their text. Samples that end up shorter than the longest are padded with zero rows.
    """

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        samples = []
        for i in range(text_embeds.shape[0]):
            places = (input_ids[i] == self.image_token_id).nonzero().flatten().tolist()
            if not places:
                samples.append(text_embeds[i])
                continue
            images = visual_embeds[i].chunk(len(places))
            if len(images) < len(places):
                raise _too_few(self, i, len(places), visual_embeds.shape[1], "image placeholders")
            pieces, after = [], 0
            for place, image in zip(places, images, strict=True):
                pieces += [text_embeds[i, after:place], image]
                after = place + 1
            samples.append(torch.cat([*pieces, text_embeds[i, after:]]))
        longest = max(s.shape[0] for s in samples)
        return torch.stack([F.pad(s, (0, 0, 0, longest - s.shape[0])) for s in samples])


def _replace_positions(adapter: torch.nn.Module, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                       positions: list[torch.Tensor], what: str) -> torch.Tensor:
    """``text_embeds`` with sample ``i``'s ``positions[i]`` replaced by its first visual tokens,
    one for one (the sequence keeps its length)."""
    out = text_embeds.clone()
    for i, where in enumerate(positions):
        if where.numel() > visual_embeds.shape[1]:
            raise _too_few(adapter, i, where.numel(), visual_embeds.shape[1], what)
        out[i, where] = visual_embeds[i, :where.numel()]
    return out


class InternVLFusionAdapter(ModalityFusionSPAdapter):
    """InternVL: each ``IMG_CONTEXT`` token (``image_token_id``) becomes one visual token, in
    order; ``IMG_START``/``IMG_END`` stay text (the sequence keeps its length)."""

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        positions = [(ids == self.image_token_id).nonzero().flatten() for ids in input_ids]
        return _replace_positions(self, text_embeds, visual_embeds, positions, "IMG_CONTEXT tokens")


class Qwen2VLFusionAdapter(_FusionSP):
    """Qwen2-VL: the tokens strictly between each ``vision_start``/``vision_end`` pair become
    visual tokens, one for one, in order; the boundary tokens stay text.

    Args:
        projection: the vision merger (``visual.merger``).
        process_group: the sequence-parallel group.
        vision_start_token_id, vision_end_token_id: ``<|vision_start|>`` and ``<|vision_end|>``.

    Raises (from ``forward``): UsageError when a sample's start and end tokens do not pair up in
    order (DeepSpeed pairs them blindly).
    """

    def __init__(self, projection: torch.nn.Module, process_group: Any, vision_start_token_id: int,
                 vision_end_token_id: int) -> None:
        super().__init__(projection, process_group)
        self.vision_start_token_id = vision_start_token_id
        self.vision_end_token_id = vision_end_token_id

    def _splice_visual_into_text(self, text_embeds: torch.Tensor, visual_embeds: torch.Tensor,
                                 input_ids: torch.Tensor) -> torch.Tensor:
        positions = []
        for i, ids in enumerate(input_ids):
            starts = (ids == self.vision_start_token_id).nonzero().flatten().tolist()
            ends = (ids == self.vision_end_token_id).nonzero().flatten().tolist()
            bounds = [b for pair in zip(starts, ends, strict=False) for b in pair]  # lengths checked next
            if len(starts) != len(ends) or bounds != sorted(bounds):
                raise UsageError(f"{type(self).__name__}: sample {i} of input_ids has vision_start tokens at "
                                 f"{starts} and vision_end tokens at {ends}; each start needs its end after it, "
                                 "before the next start")
            inner = [p for s, e in zip(starts, ends, strict=True) for p in range(s + 1, e)]
            positions.append(torch.tensor(inner, dtype=torch.long, device=text_embeds.device))
        return _replace_positions(self, text_embeds, visual_embeds, positions, "vision placeholder tokens")
