"""What libraries write into a ds_config that a user would not: ``"auto"`` left unfilled, dotted keys.

Hugging Face's Trainer fills every ``"auto"`` before it calls ``deepspeed.initialize``, but other
callers pass the same config on unfilled: TRL's reference-model helper (DPO, KTO, GRPO, RLOO, GKD)
builds its engine before the Trainer has finished the config, so hidden-size keys
(``zero_optimization.reduce_bucket_size``...) and scheduler steps may still say ``"auto"``, and it adds
top-level keys such as ``"zero_optimization.reduce_bucket_size"`` meant for the section.

DeepSpeed 0.19.8 reads such an ``"auto"`` as "not given" (its config models drop them) and ignores
unknown top-level keys. ``client_forms`` does the same, but never silently: it returns a copy of
the config without them and one note naming the keys, which ``initialize`` prints once on rank 0.
Typos stay errors: a dotted key must name a real key of a real section.

``"auto"`` stays an error where no default exists (``optimizer.params`` and ``scheduler.params``,
which DeepSpeed passes to the optimizer and scheduler as they are) and for the batch sizes when
none is left to complete the triad (``ds_config`` says so). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean

__all__ = ["ClientForms", "client_forms"]

AUTO = "auto"
# Sections whose params go to an optimizer or scheduler as they are: no default to fall back on.
_NO_DEFAULT = ("optimizer", "scheduler")


@dataclass(frozen=True)
class ClientForms:
    """A config without client placeholders, and what was taken out."""

    raw: dict[str, Any]
    auto: tuple[str, ...] = ()
    """Key paths whose ``"auto"`` now means the default."""
    dotted: tuple[str, ...] = ()
    """Top-level ``section.key`` keys, ignored (as DeepSpeed ignores them)."""

    @property
    def notes(self) -> tuple[str, ...]:
        """At most two lines for the user, one per kind."""
        notes = []
        if self.auto:
            notes.append(f"'auto' left unfilled (no Hugging Face Trainer filled it) in {_names(self.auto)}: "
                         "the defaults are used, as DeepSpeed does; put numbers there to choose")
        if self.dotted:
            notes.append(f"top-level keys {_names(self.dotted)} are ignored, as DeepSpeed ignores them; "
                         "to set one, put it inside its section ({\"zero_optimization\": {\"key\": ...}})")
        return tuple(notes)


def client_forms(raw: Mapping[str, Any], sections: Mapping[str, type], scalars: Mapping[str, Any]) -> ClientForms:
    """``raw`` without unfilled ``"auto"`` values and dotted top-level keys.

    Args:
        raw: the config as given (not modified).
        sections: top-level section name -> its dataclass (for the keys a dotted key may name).
        scalars: the top-level scalar keys that have a default.

    Raises:
        ConfigError: a dotted key whose section or key does not exist (did-you-mean).
    """
    out: dict[str, Any] = {}
    auto: list[str] = []
    dotted: list[str] = []
    for key, value in raw.items():
        head, dot, tail = str(key).partition(".")
        if dot and head in sections:
            _check_dotted(head, tail, sections[head], str(key))
            dotted.append(str(key))
        elif value == AUTO and key in scalars:
            auto.append(key)
        elif key in sections and key not in _NO_DEFAULT and isinstance(value, Mapping):
            out[key] = _without_auto(value, sections[key], key, auto)
        else:
            out[key] = value
    return ClientForms(out, tuple(auto), tuple(dotted))


def _without_auto(section: Mapping[str, Any], cls: type, path: str, found: list[str]) -> dict[str, Any]:
    """A copy of ``section`` (and its sub-sections) without the ``"auto"`` values of keys ``cls``
    knows, their paths noted. Unknown keys stay, for the parser's did-you-mean; so do keys where
    ``"auto"`` is a real value (``AUTO_OK``: ``pipeline.stages``)."""
    known, keep = _known_keys(cls), getattr(cls, "AUTO_OK", ())
    subsections = {f.name: type(f.default) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default)}
    out = {}
    for key, value in section.items():
        where = f"{path}.{key}"
        if isinstance(value, Mapping) and key in subsections:
            out[key] = _without_auto(value, subsections[key], where, found)
        elif value == AUTO and key in known and key not in keep:
            found.append(where)
        else:
            out[key] = value
    return out


def _check_dotted(section: str, tail: str, cls: type, key: str) -> None:
    name = tail.partition(".")[0]
    known = _known_keys(cls)
    if name not in known:
        hint = did_you_mean(name, known)
        raise ConfigError(f"unknown key: '{section}' has no key '{name}'{hint}", key=key)


def _known_keys(cls: type) -> set[str]:
    """Every key a section accepts: its fields, aliases, and the keys it checks or refuses."""
    names = {f.name for f in dataclasses.fields(cls)}
    for extra in ("STAGE3_ALIASES", "STAGE3_ONLY", "UNIMPLEMENTED", "INERT"):
        names |= set(getattr(cls, extra, ()))
    return names


def _names(paths: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(f"'{p}'" for p in paths[:limit])
    return shown if len(paths) <= limit else f"{shown} and {len(paths) - limit} more"
