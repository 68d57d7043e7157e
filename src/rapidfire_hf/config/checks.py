"""Value checks attached to config fields (``metadata={"check": ...}``).

A check validates and normalises one value (``__call__``), describes what it allows (``allowed``), and
turns the text of an environment variable into a value of the right type (``parse_env``). Text that does
not convert is passed through unchanged, so that the ordinary check rejects it with the ordinary message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from rapidfire_hf.config.errors import ConfigError, invalid_value

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class Check:
    """Base class: validate one value of a config field."""

    allowed: str = "any value"

    def __call__(self, key: str, value: Any) -> Any:
        """Return ``value`` normalised, or raise ConfigError naming ``key``, ``value`` and ``allowed``."""
        return value

    def parse_env(self, text: str) -> Any:
        """Convert the text of an environment variable; unconvertible text is returned as is."""
        return text

    def fail(self, key: str, value: Any):
        raise invalid_value(key, value, self.allowed)


@dataclass(frozen=True)
class Bool(Check):
    """A boolean (YAML true/false). Environment text: 1/0, true/false, yes/no, on/off."""

    @property
    def allowed(self) -> str:
        return "true or false"

    def __call__(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.fail(key, value)
        return value

    def parse_env(self, text: str) -> Any:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        return text


@dataclass(frozen=True)
class Int(Check):
    """An integer (not a bool) at least ``min`` and, when ``max`` is set, at most ``max``."""

    min: int = 0
    max: int | None = None

    @property
    def allowed(self) -> str:
        if self.max is None:
            return f"an integer >= {self.min}"
        return f"an integer >= {self.min} and <= {self.max}"

    def __call__(self, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < self.min:
            self.fail(key, value)
        if self.max is not None and value > self.max:
            self.fail(key, value)
        return value

    def parse_env(self, text: str) -> Any:
        try:
            return int(text.strip())
        except ValueError:
            return text


@dataclass(frozen=True)
class Float(Check):
    """A finite real number (ints accepted, bools not) between ``low`` and ``high``.

    ``open_low`` / ``open_high`` exclude the bound itself; ``high=math.inf`` means no upper bound (the
    number must still be finite).
    """

    low: float = 0.0
    high: float = 1.0
    open_low: bool = False
    open_high: bool = False

    @property
    def allowed(self) -> str:
        if math.isinf(self.high):
            if math.isinf(self.low):
                return "a finite number"
            return f"a finite number {'>' if self.open_low else '>='} {self.low:g}"
        left, right = "(" if self.open_low else "[", ")" if self.open_high else "]"
        return f"a number in {left}{self.low:g}, {self.high:g}{right}"

    def __call__(self, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(key, value)
        too_low = value <= self.low if self.open_low else value < self.low
        too_high = value >= self.high if self.open_high else value > self.high
        if too_low or too_high:
            self.fail(key, value)
        return float(value)

    def parse_env(self, text: str) -> Any:
        try:
            return float(text.strip())
        except ValueError:
            return text


@dataclass(frozen=True)
class Optional(Check):
    """None, or a value ``inner`` accepts; ``none`` says what None means (shown in the error)."""

    inner: Check
    none: str = "not set"

    @property
    def allowed(self) -> str:
        return f"{self.inner.allowed}, or None ({self.none})"

    def __call__(self, key: str, value: Any) -> Any:
        if value is None:
            return None
        try:
            return self.inner(key, value)
        except ConfigError:
            self.fail(key, value)

    def parse_env(self, text: str) -> Any:
        return None if text.strip().lower() in {"none", "null"} else self.inner.parse_env(text)


@dataclass(frozen=True)
class AutoOr(Check):
    """``"auto"`` (left to the throughput planner), or a value ``inner`` accepts."""

    inner: Check

    @property
    def allowed(self) -> str:
        return f"'auto' (the planner chooses) or {self.inner.allowed}"

    def __call__(self, key: str, value: Any) -> Any:
        if value == "auto":
            return value
        try:
            return self.inner(key, value)
        except ConfigError:
            self.fail(key, value)

    def parse_env(self, text: str) -> Any:
        return "auto" if text.strip().lower() == "auto" else self.inner.parse_env(text)


@dataclass(frozen=True)
class Str(Check):
    """A non-empty string."""

    @property
    def allowed(self) -> str:
        return "a non-empty string"

    def __call__(self, key: str, value: Any) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(key, value)
        return value


@dataclass(frozen=True)
class FloatList(Check):
    """A non-empty list of finite numbers (each checked by ``item``)."""

    item: Check = Float(-math.inf, math.inf)

    @property
    def allowed(self) -> str:
        return "a non-empty list of finite numbers"

    def __call__(self, key: str, value: Any) -> list[float]:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
            self.fail(key, value)
        out = []
        for item in value:
            try:
                out.append(self.item(key, item))
            except ConfigError:
                self.fail(key, value)
        return out


@dataclass(frozen=True)
class Choice(Check):
    """One member of a ``str`` enum, given as the member or its value."""

    enum: type[Enum]

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(repr(m.value) for m in self.enum)

    def __call__(self, key: str, value: Any) -> Enum:
        if isinstance(value, self.enum):
            return value
        if isinstance(value, str):
            for member in self.enum:
                if member.value == value:
                    return member
        self.fail(key, value)

    def parse_env(self, text: str) -> Any:
        return text.strip()


@dataclass(frozen=True)
class Among(Check):
    """One of a few plain values (strings), compared with ``==``."""

    values: tuple[Any, ...]

    @property
    def allowed(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)

    def __call__(self, key: str, value: Any) -> Any:
        if not isinstance(value, (str, int, float)) or value not in self.values:
            self.fail(key, value)
        return value


@dataclass(frozen=True)
class OptionalStr(Check):
    """A non-empty string, or None (YAML null). Environment text "" or "none" means None."""

    @property
    def allowed(self) -> str:
        return "a non-empty string or null"

    def __call__(self, key: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            self.fail(key, value)
        return value

    def parse_env(self, text: str) -> Any:
        return None if text.strip().lower() in {"", "none", "null"} else text


@dataclass(frozen=True)
class StrList(Check):
    """A list of strings, each from ``choices``. A single string is a one-item list; "none" is the empty list."""

    choices: tuple[str, ...] = ()

    @property
    def allowed(self) -> str:
        return "a list of " + ", ".join(repr(c) for c in self.choices) + " (or 'none')"

    def __call__(self, key: str, value: Any) -> list[str]:
        if isinstance(value, str):
            value = [] if value == "none" else [value]
        if not isinstance(value, (list, tuple)):
            self.fail(key, value)
        for item in value:
            if item not in self.choices:
                self.fail(key, value)
        return list(value)

    def parse_env(self, text: str) -> Any:
        items = [part.strip() for part in text.split(",") if part.strip()]
        return [] if items in ([], ["none"]) else items
