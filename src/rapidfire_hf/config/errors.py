"""``ConfigError``: one exception for every configuration problem, with a message that names the key.

Every message has the same parts: where the value came from (a file, an environment variable), the key
path (``precision.fallback[1].condition``), the offending value, and what is allowed. Sections raise with
their own key path; callers that know more (the index of a rule, the file being read) add it with
``with_prefix`` / ``with_source`` instead of re-wording the message.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

_NO_VALUE = object()

# Longest quote of a user's value (or of a parser's message) an error message holds: a 273-byte YAML
# file of nested aliases expands into a value whose repr is millions of characters.
MAX_QUOTE = 200


def quote(value: Any, limit: int = MAX_QUOTE) -> str:
    """``repr(value)`` cut to ``limit`` characters (with the number left out), never the whole of a huge value.

    Containers are quoted to a few levels and items (``reprlib``), so quoting a deeply shared structure
    (a YAML alias bomb) costs little.
    """
    try:
        text = _bounded_repr(value, limit)
    except Exception:  # a user's object whose __repr__ fails still gets named
        text = f"<{type(value).__name__} object>"
    return clip(text, limit)


def _bounded_repr(value: Any, limit: int) -> str:
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = short.maxlong = limit
    short.maxlevel = 3
    return short.repr(value)


def clip(text: str, limit: int = MAX_QUOTE) -> str:
    """``text`` itself when short, else its first ``limit`` characters and how many were left out."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class ConfigError(ValueError):
    """A configuration value, key, file or preset that rapidfire_hf cannot accept.

    Attributes:
        key: Dotted key path of the offending entry (``"gradient.pipeline_depth"``), or None when the
            problem is not about one key (a missing file, invalid YAML).
        value: The offending value (the unknown key itself for an unknown key); absent for file errors.
        allowed: Human-readable description of what is allowed.
        source: Where the value came from (``"config/advanced.yaml"``,
            ``"environment variable RAPIDFIRE_GRADIENT_PIPELINE_DEPTH"``), or None.
    """

    def __init__(
        self,
        problem: str,
        *,
        key: str | None = None,
        value: Any = _NO_VALUE,
        allowed: str | None = None,
        source: str | None = None,
    ) -> None:
        self.problem = problem
        self.key = key
        self.value = None if value is _NO_VALUE else value
        self._has_value = value is not _NO_VALUE
        self.allowed = allowed
        self.source = source
        super().__init__(self._render())

    def _render(self) -> str:
        parts = []
        if self.source:
            parts.append(f"{self.source}: ")
        if self.key:
            parts.append(f"{self.key}: ")
        parts.append(clip(self.problem, 4 * MAX_QUOTE))
        if self._has_value:
            parts.append(f"; got {quote(self.value)} ({type(self.value).__name__})")
        if self.allowed:
            parts.append(f"; allowed: {clip(self.allowed, 10 * MAX_QUOTE)}")
        return "".join(parts)

    def brief(self) -> str:
        """One line in the ``name=value: problem; allowed: ...`` form (``ConfigErrors`` lists these)."""
        if self.key and self._has_value:
            text = f"{self.key}={quote(self.value)}: {self.problem}"
        elif self.key:
            text = f"{self.key}: {self.problem}"
        else:
            text = self.problem
        return clip(text, 4 * MAX_QUOTE) + (f"; allowed: {self.allowed}" if self.allowed else "")

    def _copy(self, **changes: Any) -> ConfigError:
        fields = {
            "key": self.key,
            "value": self.value if self._has_value else _NO_VALUE,
            "allowed": self.allowed,
            "source": self.source,
        }
        fields.update(changes)
        return ConfigError(self.problem, **fields)

    def with_prefix(self, prefix: str) -> ConfigError:
        """Return the same error with ``prefix`` put before its key path (``"fallback[1]"`` + ``"condition"``)."""
        key = f"{prefix}.{self.key}" if self.key else prefix
        return self._copy(key=key)

    def with_source(self, source: str) -> ConfigError:
        """Return the same error, saying it came from ``source`` (a file or an environment variable)."""
        return self._copy(source=source)


class ConfigErrors(ConfigError):
    """Several problems found in one pass (every field is checked before raising), one line each.

    ``key``, ``value`` and ``allowed`` are those of the first problem; ``errors`` holds them all.
    """

    def __init__(self, title: str, errors: Iterable[ConfigError]) -> None:
        self.title = title
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(
            first.problem,
            key=first.key,
            value=first.value if first._has_value else _NO_VALUE,
            allowed=first.allowed,
            source=first.source,
        )

    def _render(self) -> str:
        return self.title + "".join(f"\n  - {err.brief()}" for err in self.errors)


def invalid_value(key: str, value: Any, allowed: str, problem: str = "invalid value") -> ConfigError:
    """Build the error for a value of the wrong type or out of range."""
    return ConfigError(problem, key=key, value=value, allowed=allowed)


def unknown_key(key: str, valid: Iterable[str], prefix: str = "") -> ConfigError:
    """Build the error for an unknown key, suggesting the closest valid key (difflib).

    Args:
        key: The unknown key, without its prefix.
        valid: The keys valid at that level.
        prefix: Dotted path of the mapping holding the key ("" at top level).
    """
    valid = list(valid)
    full = f"{prefix}.{key}" if prefix else str(key)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    problem = "unknown key"
    if close:
        problem += f" (did you mean {(prefix + '.' if prefix else '') + close[0]!r}?)"
    where = f"keys under {prefix!r}" if prefix else "top-level keys"
    return ConfigError(problem, key=full, allowed=f"{where}: {', '.join(valid)}")
