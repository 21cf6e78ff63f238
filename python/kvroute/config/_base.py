"""The pieces every config model shares: `ConfigError`, the strict base model (unknown keys
named with the allowed ones), the numeric field types, ``*_s`` / ``*_secs`` durations, the
ZeroMQ endpoint check, and the native defaults (``_DEFAULTS``, cpp/router/router.h
RouterOptions).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Dict, List, Mapping, Optional

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    model_validator,
)

from kvroute import _core

# The native defaults (cpp/router/router.h RouterOptions): every default below comes from here
# or from the `kvroute.policies` classes.
_DEFAULTS = _core.RouterOptions()



class ConfigError(ValueError):
    """An invalid router configuration. ``problems`` lists ``(key path, message)`` pairs."""

    def __init__(self, message: str, problems: Optional[List[tuple]] = None) -> None:
        super().__init__(message)
        self.problems = list(problems or [])


# -- building blocks ---------------------------------------------------------------------------

class _Model(BaseModel):
    """Strict, closed, immutable. Unknown keys are reported with the keys that are allowed."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # Input keys a subclass accepts and rewrites in `_prepare` (shorthands), besides its fields.
    _shorthand_keys: ClassVar[tuple] = ()

    @classmethod
    def _allowed_keys(cls) -> List[str]:
        keys: List[str] = ["type"] if "type" in cls.model_fields else []
        for name, field in cls.model_fields.items():
            if name == "type":
                continue
            keys.append(name)
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                keys.extend(c for c in alias.choices if isinstance(c, str) and c not in keys)
            elif isinstance(alias, str) and alias not in keys:
                keys.append(alias)
        keys.extend(k for k in cls._shorthand_keys if k not in keys)
        return keys

    @classmethod
    def _prepare(cls, data: Dict[str, Any]) -> Dict[str, Any]:
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_keys(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        allowed = cls._allowed_keys()
        # An unknown key stays in the mapping, its value wrapped: pydantic then reports it
        # (extra_forbidden, with its path) together with every other problem at every level,
        # and `_message` names the allowed keys.
        data = {k: (v if k in allowed else _UnknownKey(allowed, v)) for k, v in data.items()}
        for field in cls.model_fields.values():
            alias = field.validation_alias
            if isinstance(alias, AliasChoices):
                given = [c for c in alias.choices if isinstance(c, str) and c in data]
                if len(given) > 1:
                    raise ValueError(f"{' and '.join(given)} name the same setting; give one")
        return cls._prepare(dict(data))


class _UnknownKey:
    """The value of a key its mapping does not know, with the keys that mapping allows."""

    def __init__(self, allowed: List[str], value: Any) -> None:
        self.allowed = allowed
        self.value = value


NonNegFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]
PosFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
PosInt = Annotated[int, Field(ge=1)]


def _seconds(name: str, default: Any = None, **kw: Any) -> Any:
    """A ``<name>_s`` field (seconds) that also accepts ``<name>_secs``, the vLLM router's
    spelling, without a warning (users bring those files as they are)."""
    if default is None and "default_factory" not in kw:
        return Field(validation_alias=AliasChoices(f"{name}_s", f"{name}_secs"), **kw)
    return Field(default, validation_alias=AliasChoices(f"{name}_s", f"{name}_secs"), **kw)
_ENDPOINT_HELP = "a ZeroMQ endpoint such as tcp://10.0.0.5:5557"


def _check_endpoint(v: Optional[str], what: str) -> Optional[str]:
    if v is None:
        return v
    scheme, sep, rest = v.partition("://")
    if not sep or not scheme or not rest or any(c.isspace() for c in v):
        raise ValueError(f"{what} must be {_ENDPOINT_HELP}, got {v!r}")
    return v
