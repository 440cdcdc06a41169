"""DeepSpeed's ``deepspeed.runtime.config_utils``: ``DeepSpeedConfigModel``, the pydantic base class
DeepSpeed's own config sections (and some libraries' configs) derive from.

dslaunch's configs are frozen dataclasses (``runtime/config``) and dslaunch does not depend on
pydantic; the class is built on first use where pydantic 2 is installed, else the import says
what is missing. As DeepSpeed's: unknown keys are refused, fields may be given by alias or name,
assignments are validated, ``"auto"`` values are dropped (the default stands) unless
``strict=True``, and a field marked ``json_schema_extra={"deprecated": True, "new_param": "x",
"new_param_fn": f}`` that is set moves its value (through ``f``) to ``x`` with a warning; giving
both is an ``AssertionError``.

``as_validation_error`` gives dslaunch's config classes under DeepSpeed's names
(``DeepSpeedFP16Config(...)``, ``DeepSpeedZeroConfig(...)``) DeepSpeed's error class: a bad value
there is a ``ConfigError`` (one line, naming the key) that is also pydantic's ``ValidationError``,
which DeepSpeed's pydantic models raise and scripts catch.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from dslaunch.errors import ConfigError

__all__ = ["DeepSpeedConfigModel", "as_validation_error"]  # noqa: F822 (built on first use by __getattr__)

log = logging.getLogger("dslaunch")


def _build() -> type:
    try:
        from pydantic import BaseModel, ConfigDict
    except ImportError as err:
        raise ImportError("deepspeed.runtime.config_utils.DeepSpeedConfigModel needs pydantic 2 "
                          "(pip install pydantic); dslaunch's own configs do not use it") from err

    class DeepSpeedConfigModel(BaseModel):
        model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                                  populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                                  protected_namespaces=())

        def __init__(self, strict: bool = False, **data: Any):
            if not strict:  # "auto": a Hugging Face placeholder meaning "the default"
                data = {k: v for k, v in data.items() if not (isinstance(v, str) and v == "auto")}
            super().__init__(**data)
            for name, info in type(self).model_fields.items():
                extra = info.json_schema_extra
                if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                    self._move_deprecated(name, extra)

        def _move_deprecated(self, name: str, extra: dict[str, Any]) -> None:
            new = str(extra.get("new_param", ""))
            log.warning("config parameter %s is deprecated%s", name, f"; use {new} instead" if new else "")
            if not new or not extra.get("set_new_param", True):
                return
            *path, leaf = new.split(".")
            owner = functools.reduce(getattr, path, self)
            if leaf in owner.model_fields_set:
                raise AssertionError(f"give either the deprecated '{name}' or '{new}', not both")
            convert = extra.get("new_param_fn", lambda value: value)
            setattr(owner, leaf, convert(getattr(self, name)))

    return DeepSpeedConfigModel


@functools.cache
def _model() -> type:
    return _build()


@functools.cache
def _validation_error_class() -> type | None:
    try:
        from pydantic import ValidationError
    except ImportError:  # no pydantic: no script can be catching its class
        return None

    class ConfigValidationError(ValidationError, ConfigError):
        """A ``ConfigError`` that is also pydantic's ``ValidationError``; its message is the
        ``ConfigError``'s one line, its ``errors()`` pydantic's."""

        def __init__(self, *args: Any) -> None:  # pydantic's __new__ built it; ConfigError's would not fit
            self.original: ConfigError | None = None

        def __str__(self) -> str:
            return str(self.original)

        def __reduce__(self) -> tuple:  # a rank's error crosses to the parent pickled
            return as_validation_error, (self.original, self.title)

    ConfigValidationError.__qualname__ = "ConfigValidationError"  # tracebacks name it without <locals>
    return ConfigValidationError


def as_validation_error(err: ConfigError, title: str) -> ConfigError:
    """``err`` as DeepSpeed's pydantic ``ValidationError`` of the model ``title`` (still a
    ``ConfigError``, same message and key); ``err`` itself where pydantic is not installed."""
    cls = _validation_error_class()
    if cls is None:
        return err
    loc = tuple(err.key.split(".")[1:]) if err.key else ()
    out = cls.from_exception_data(title, [{"type": "value_error", "loc": loc, "input": None,
                                           "ctx": {"error": ValueError(str(err))}}])
    out.original, out.key, out.source = err, err.key, err.source
    return out


def __getattr__(name: str) -> Any:
    if name == "DeepSpeedConfigModel":
        return _model()
    raise AttributeError(f"module 'deepspeed.runtime.config_utils' has no attribute {name!r}")
