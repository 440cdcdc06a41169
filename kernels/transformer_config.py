"""``DeepSpeedTransformerConfig``: the settings of DeepSpeed's fused training transformer layer
(``deepspeed.ops.transformer.DeepSpeedTransformerConfig``), as a frozen dataclass checked once.

Every argument of DeepSpeed 0.19.8's constructor, with its default. DeepSpeed's ``-1`` means "not
given" for the sizes, ratios and ranks; a value that is given must make sense (one
``ConfigError`` line naming the argument and what is valid). What the layer itself needs (a hidden
size, heads, dropout ratios) is checked when a layer is built (``require_layer_settings``), so a
blank ``DeepSpeedTransformerConfig()`` still constructs, as in DeepSpeed.

Differences from DeepSpeed: the config is frozen (DeepSpeed's tests assign fields after
construction; here ``dataclasses.replace(config, hidden_size=...)`` makes the changed copy) and
the layer keeps its ``layer_id`` itself instead of writing it into the shared config.
``from_dict`` names an unknown key with the closest valid one (DeepSpeed stores any key);
``from_json_file`` reads UTF-8 or UTF-16 (DeepSpeed only UTF-16). Without a hidden size,
``intermediate_size`` stays -1 (DeepSpeed computes ``4 * -1``). Arguments, order and defaults
are checked against real DeepSpeed's in the tests.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean, quote
from dslaunch.textfile import read_json

__all__ = ["DeepSpeedTransformerConfig", "require_layer_settings"]

_INTS = ("batch_size", "hidden_size", "intermediate_size", "heads", "num_hidden_layers", "local_rank", "seed")
_RATIOS = ("attn_dropout_ratio", "hidden_dropout_ratio")
_BOOLS = ("fp16", "pre_layer_norm", "normalize_invertible", "gelu_checkpoint", "adjust_init_range",
          "attn_dropout_checkpoint", "stochastic_mode", "return_tuple", "training")
_MAX_JSON_BYTES = 1 << 20
# state DeepSpeed's layer writes into its config object: in a dump of ``config.__dict__``, not settings
_DEEPSPEED_STATE = ("layer_id", "test_gemm", "is_grad_enabled")


def _fail(key: str, value: Any, valid: str) -> ConfigError:
    return ConfigError(f"{quote(value)} is not valid; expected {valid}", key=f"DeepSpeedTransformerConfig.{key}")


@dataclass(frozen=True)
class DeepSpeedTransformerConfig:
    """DeepSpeed's transformer-layer settings (its argument names, order and defaults).

    Args:
        batch_size: the largest batch the layer sees (DeepSpeed sizes its buffers by it; here
            informational: any batch runs).
        hidden_size, intermediate_size, heads: the layer's widths; ``intermediate_size`` -1 is
            ``4 * hidden_size``.
        attn_dropout_ratio, hidden_dropout_ratio: dropout on the attention probabilities and on
            the two residual branches, in [0, 1).
        num_hidden_layers, initializer_range: the initial weights' normal std is
            ``initializer_range``; the two output projections use
            ``initializer_range / sqrt(2 * num_hidden_layers)`` when ``adjust_init_range``.
        layer_norm_eps: the LayerNorms' epsilon.
        local_rank: the CUDA device the layer's parameters go to (-1: the current one).
        seed: accepted for DeepSpeed's signature; dropout draws from torch's generator.
        fp16: DeepSpeed's fp16 kernels; here the layer computes in its parameters' dtype
            (fp32, fp16 or bf16), so this only documents the intent.
        pre_layer_norm: Pre-LN (True, DeepSpeed's default) or Post-LN (BERT's original).
        normalize_invertible, gelu_checkpoint, attn_dropout_checkpoint: memory savers that keep
            the same results: the LayerNorm inputs are recomputed from their outputs, the GeLU
            output and the attention-dropout output are recomputed in backward.
        stochastic_mode: DeepSpeed's faster non-deterministic CUDA kernels; no effect here.
        return_tuple: forward returns ``(output,)`` instead of ``output``.
        training: the mode a new layer starts in (``layer.train()``/``eval()`` change it).

    Raises:
        ConfigError: a value of the wrong type or outside its range, named with what is valid.
    """

    batch_size: int = -1
    hidden_size: int = -1
    intermediate_size: int = -1
    heads: int = -1
    attn_dropout_ratio: float = -1
    hidden_dropout_ratio: float = -1
    num_hidden_layers: int = -1
    initializer_range: float = -1
    layer_norm_eps: float = 1e-12
    local_rank: int = -1
    seed: int = -1
    fp16: bool = False
    pre_layer_norm: bool = True
    normalize_invertible: bool = False
    gelu_checkpoint: bool = False
    adjust_init_range: bool = True
    attn_dropout_checkpoint: bool = False
    stochastic_mode: bool = False
    return_tuple: bool = False
    training: bool = True

    def __post_init__(self) -> None:
        for key in _INTS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1
                                                                         and key not in ("local_rank", "seed")):
                raise _fail(key, value, "a positive integer, or -1 for not given")
            if key in ("local_rank", "seed") and value < -1:
                raise _fail(key, value, "an integer >= 0, or -1 for not given")
        for key in _RATIOS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 <= value < 1 or value == -1):
                raise _fail(key, value, "a dropout ratio in [0, 1), or -1 for not given")
        for key, low in (("initializer_range", 0.0), ("layer_norm_eps", 0.0)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > low or (
                    key == "initializer_range" and value == -1)):
                raise _fail(key, value, "a number > 0" + (", or -1 for not given" if key == "initializer_range" else ""))
        for key in _BOOLS:
            if not isinstance(getattr(self, key), bool):
                raise _fail(key, getattr(self, key), "true or false")
        if self.hidden_size > 0 and self.heads > 0 and self.hidden_size % self.heads:
            raise _fail("heads", self.heads, f"a divisor of hidden_size ({self.hidden_size})")
        if self.intermediate_size == -1 and self.hidden_size > 0:
            # DeepSpeed's rule: no intermediate size given means 4 * hidden_size
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)

    @classmethod
    def from_dict(cls, json_object: Mapping[str, Any]) -> DeepSpeedTransformerConfig:
        """A config from a dict of its argument names (DeepSpeed's ``from_dict``); the state keys
        DeepSpeed's layer adds to its config (``layer_id``, ``test_gemm``, ``is_grad_enabled``) are
        skipped, so a dump of a DeepSpeed config's ``__dict__`` loads.

        Raises:
            ConfigError: an unknown key (with the closest valid one) or an invalid value.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in json_object:
            if key not in names and key not in _DEEPSPEED_STATE:
                raise ConfigError(f"unknown key{did_you_mean(str(key), names)}; valid keys: {', '.join(names)}",
                                  key=f"DeepSpeedTransformerConfig.{key}")
        return cls(**{k: v for k, v in json_object.items() if k not in _DEEPSPEED_STATE})

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> DeepSpeedTransformerConfig:
        """A config from a JSON file of its argument names (UTF-8, or UTF-16 as DeepSpeed writes it).

        Raises:
            ConfigError: the file is unreadable or not a JSON object, or as ``from_dict``.
        """
        def fail(message: str, line: int | None) -> ConfigError:
            return ConfigError(message, source=f"{json_file}:{line}" if line else str(json_file))

        value = read_json(json_file, _MAX_JSON_BYTES, fail)
        if not isinstance(value, dict):
            raise fail("expected a JSON object of DeepSpeedTransformerConfig's arguments", None)
        return cls.from_dict(value)


def require_layer_settings(config: DeepSpeedTransformerConfig, initializing: bool) -> None:
    """Check that ``config`` has what a layer needs: sizes, heads and dropout ratios given, and when
    the layer draws its own weights (``initializing``), ``initializer_range`` (and
    ``num_hidden_layers`` with ``adjust_init_range``).

    Raises:
        ConfigError: the first missing setting, named with what to give.
    """
    if not isinstance(config, DeepSpeedTransformerConfig):
        raise ConfigError(f"expected a DeepSpeedTransformerConfig, got {type(config).__name__}",
                          key="DeepSpeedTransformerLayer.config")
    needed = ["hidden_size", "heads", *_RATIOS]
    if initializing:
        needed += ["initializer_range"] + (["num_hidden_layers"] if config.adjust_init_range else [])
    for key in needed:
        if getattr(config, key) == -1:
            raise ConfigError(f"not given (-1); DeepSpeedTransformerLayer needs it: pass {key}=... to "
                              "DeepSpeedTransformerConfig", key=f"DeepSpeedTransformerConfig.{key}")
