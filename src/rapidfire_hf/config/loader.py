"""``load_config``: one entry point for every spelling of a rapidfire_hf configuration.

Resolution order, later wins:

1. the preset named by a top-level ``preset`` key (``balanced`` when absent);
2. the sections of the full nested form (``gradient``, ``memory``, ``precision``, ``logging``), key by key;
3. the short-form keys ``gradient_pipeline`` (bool), ``memory_optimization`` (level) and ``precision``
   given as a string: a mode (``"adaptive"``/``"static"``) or a dtype (``"bf16"``, meaning static bf16);
4. ``RAPIDFIRE_<SECTION>_<KEY>`` environment variables, e.g. ``RAPIDFIRE_GRADIENT_PIPELINE_DEPTH=4``,
   ``RAPIDFIRE_MEMORY_OPTIMIZATION=aggressive``, ``RAPIDFIRE_PRECISION_INITIAL=fp16``,
   ``RAPIDFIRE_LOGGING_REPORT_TO=wandb,tensorboard``,
   ``RAPIDFIRE_PRECISION_FALLBACK="grad_norm > 1 -> switch_to fp32; throughput < 100 -> disable_pipeline"``.

The prefixes ``RAPIDFIRE_GRADIENT_``, ``RAPIDFIRE_MEMORY_``, ``RAPIDFIRE_PRECISION_`` and
``RAPIDFIRE_LOGGING_`` belong to the configuration: an unknown name under them is an error (with the
closest valid name), so that a typo is not silently ignored. Other ``RAPIDFIRE_*`` names are left alone.
Names are case-sensitive: ``rapidfire_gradient_pipeline_depth`` is refused naming the upper-case
spelling, and any other lower- or mixed-case ``rapidfire_*`` name gives a warning. An empty
``RAPIDFIRE_PRECISION_FALLBACK`` is refused (it would drop the default NaN/Inf rule); ``none`` means no rules.

A YAML file whose values, with aliases expanded, number more than ``MAX_DOCUMENT_VALUES`` is refused, and
every error quotes at most a few hundred characters of a value (``errors.MAX_QUOTE``).
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from rapidfire_hf.config.checks import Bool
from rapidfire_hf.config.errors import ConfigError, invalid_value, unknown_key
from rapidfire_hf.config.presets import PRESETS, preset_dict
from rapidfire_hf.config.schema import SECTIONS, DType, MemoryLevel, PrecisionMode, RapidFireConfig, to_plain

ENV_PREFIX = "RAPIDFIRE_"
SHORT_KEYS = ("gradient_pipeline", "memory_optimization", "precision")
TOP_LEVEL_KEYS = ("preset", *SECTIONS, *(k for k in SHORT_KEYS if k not in SECTIONS))
# Values (scalars, lists, mappings, counted as YAML aliases expand them) a config document may hold:
# config/advanced.yaml holds about 40; a few hundred bytes of nested aliases expand to billions.
MAX_DOCUMENT_VALUES = 10_000


def load_config(src: Any = None, *, env: bool = True) -> RapidFireConfig:
    """Resolve any spelling of a configuration into a validated ``RapidFireConfig``.

    Args:
        src: None (the ``balanced`` defaults); a preset name (``"conservative"``, ``"balanced"``,
            ``"aggressive"``); a path (str or Path) to a YAML file; the name of a file shipped with the
            package (``"advanced"`` or ``"config/advanced.yaml"``: see :func:`bundled_config`); a mapping in the full nested form, the
            short form (``{"gradient_pipeline": True, "memory_optimization": "aggressive",
            "precision": "adaptive"}``) or a mix, optionally with a ``preset`` key as the base; or a
            ``RapidFireConfig`` (returned as a validated copy).
        env: Apply ``RAPIDFIRE_*`` environment overrides (they beat the file).

    Returns:
        A new, validated ``RapidFireConfig``.

    Raises:
        ConfigError: naming the source, key path, value and what is allowed, for a missing file, invalid
            YAML, an unknown preset or key, a wrong type or range, an unparsable rule or a bad env value.

    Example:
        >>> load_config({"gradient_pipeline": False, "precision": "fp32"}, env=False).precision.mode.value
        'static'
    """
    data, source = _read_source(src)
    try:
        nested = resolve(data)
        RapidFireConfig.from_dict(nested)  # report file errors before env errors
    except ConfigError as err:
        if source is None:
            raise
        raise err.with_source(source) from None
    if env:
        for section, values in env_overrides().items():
            nested[section].update(values)
    return RapidFireConfig.from_dict(nested)


def _read_source(src: Any) -> tuple[Mapping[str, Any], str | None]:
    """Turn ``src`` into a mapping to resolve, and a name for error messages (the file path)."""
    if src is None:
        return {}, None
    if isinstance(src, RapidFireConfig):
        return src.to_dict(), None
    if isinstance(src, Mapping):
        return src, None
    if isinstance(src, str) and src in PRESETS:
        return {"preset": src}, None
    bundled = bundled_config(src) if isinstance(src, (str, os.PathLike)) else None
    if bundled is not None:
        return read_yaml(bundled), str(src)
    if isinstance(src, os.PathLike) or (isinstance(src, str) and _looks_like_path(src)):
        return read_yaml(src), str(src)
    if isinstance(src, str):
        try:
            preset_dict(src)  # raises "unknown preset", listing the presets and suggesting the closest
        except ConfigError as err:
            raise ConfigError(
                err.problem,
                value=src,
                allowed=f"{err.allowed}, a file shipped with the package ({', '.join(bundled_names())}) "
                "or a path to a YAML file",
            ) from None
    raise invalid_value(
        "<config>",
        src,
        "None, a preset name, a path to a YAML file, a mapping or a RapidFireConfig",
        "unsupported config source",
    )


# The repository's config/*.yaml, shipped inside the package (package data) so that an installed
# rapidfire_hf finds them from any working directory; tests/config/test_bundled_files.py keeps the two equal.
BUNDLED_DIR = Path(__file__).resolve().parent / "files"


def bundled_names() -> list[str]:
    """Names of the config files shipped with the package (``advanced``, ``aggressive``, ...)."""
    return sorted(p.stem for p in BUNDLED_DIR.glob("*.yaml"))


def bundled_config(src: str | os.PathLike) -> Path | None:
    """The shipped copy of ``config/<name>.yaml`` that ``src`` names, when ``src`` is not an existing file.

    ``"advanced"``, ``"advanced.yaml"`` and ``"config/advanced.yaml"`` all name the shipped
    ``advanced.yaml``, from any working directory; a file that exists at ``src`` is read instead (your
    own edited copy wins). Anything else returns None.
    """
    text = os.fspath(src)
    if os.path.exists(text):
        return None
    path = Path(text)
    parent = path.parent.as_posix()
    if parent not in (".", "config") or path.suffix not in ("", ".yaml", ".yml"):
        return None
    candidate = BUNDLED_DIR / f"{path.stem}.yaml"
    try:
        return candidate if candidate.is_file() else None
    except OSError:  # a name over the file system's limit names no shipped file
        return None


def _looks_like_path(text: str) -> bool:
    return (
        os.path.exists(text)
        or "/" in text
        or os.sep in text
        or Path(text).suffix in {".yaml", ".yml", ".json"}
    )


def read_yaml(path: str | os.PathLike) -> Mapping[str, Any]:
    """Read a YAML (or JSON) config file into a mapping; an empty file is an empty mapping.

    Raises:
        ConfigError: if the file is missing or unreadable, is not valid YAML, or is not a mapping.
    """
    import yaml

    path = Path(path)
    presets = ", ".join(repr(n) for n in PRESETS)
    try:
        found = path.is_file()
    except OSError as err:  # e.g. a name over the file system's limit
        raise ConfigError(f"cannot read the file: {err.strerror}", source=str(path)[:200]) from None
    if not found:
        raise ConfigError(
            "config file not found",
            value=str(path),
            allowed=f"an existing YAML file or a preset name ({presets})",
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML: {err}", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the file: {err}", source=str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            "the file must hold a mapping", value=data, allowed="a YAML mapping of sections", source=str(path)
        )
    if count_values(data, MAX_DOCUMENT_VALUES) > MAX_DOCUMENT_VALUES:
        raise ConfigError(
            f"the document expands to more than {MAX_DOCUMENT_VALUES} values (nested YAML aliases?)",
            allowed=f"a config of at most {MAX_DOCUMENT_VALUES} values, without alias expansion bombs",
            source=str(path),
        )
    return data


def count_values(data: Any, limit: int) -> int:
    """The number of values in ``data`` with shared (aliased) parts counted each time they appear.

    Stops counting past ``limit``, so the cost is bounded however far the aliases would expand.
    """
    count, stack = 0, [data]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def resolve(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Merge preset, full-form sections and short-form keys into the full nested form (plain data).

    Only keys are checked here; values are checked by ``RapidFireConfig.from_dict``.
    """
    if not isinstance(data, Mapping):
        raise invalid_value("<config>", data, "a mapping of " + ", ".join(TOP_LEVEL_KEYS))
    for key in data:
        if key not in TOP_LEVEL_KEYS:
            raise unknown_key(key, TOP_LEVEL_KEYS)
    try:
        nested = preset_dict(data.get("preset", "balanced"))
    except ConfigError as err:
        raise err.with_prefix("preset") from None
    for name, cls in SECTIONS.items():
        value = data.get(name)
        if name in SHORT_KEYS and isinstance(value, str):
            continue  # short form, below
        if value is not None:
            nested[name].update(cls.check_keys(value))
    _apply_short_form(data, nested)
    return nested


def _apply_short_form(data: Mapping[str, Any], nested: dict[str, dict[str, Any]]) -> None:
    if "gradient_pipeline" in data:
        nested["gradient"]["pipeline"] = Bool()("gradient_pipeline", data["gradient_pipeline"])
    if "memory_optimization" in data:
        nested["memory"]["optimization"] = data["memory_optimization"]
        if data["memory_optimization"] not in {m.value for m in MemoryLevel}:
            allowed = "one of " + ", ".join(repr(m.value) for m in MemoryLevel)
            raise invalid_value("memory_optimization", data["memory_optimization"], allowed)
    precision = data.get("precision")
    if isinstance(precision, str):
        if precision in {m.value for m in PrecisionMode}:
            nested["precision"]["mode"] = precision
        elif precision in {d.value for d in DType}:
            nested["precision"].update(mode="static", initial=precision)
        else:
            choices = [m.value for m in PrecisionMode] + [d.value for d in DType]
            allowed = "a mapping (full form) or one of " + ", ".join(map(repr, choices))
            raise invalid_value("precision", precision, allowed)


def env_variables() -> dict[str, tuple[str, str]]:
    """Every recognised environment variable name -> (section, field)."""
    return {
        f"{ENV_PREFIX}{section}_{f.name}".upper(): (section, f.name)
        for section, cls in SECTIONS.items()
        for f in fields(cls)
    }


def _check_case(name: str, prefixes: tuple[str, ...], known: Mapping[str, Any]) -> None:
    """Refuse a config variable spelled in the wrong case; warn about other ``rapidfire_*`` names.

    Environment names are case-sensitive on Linux and macOS, so ``rapidfire_gradient_pipeline_depth``
    would otherwise be ignored without a word.
    """
    upper = name.upper()
    if not upper.startswith(ENV_PREFIX) or upper == name:
        return
    if upper.startswith(prefixes):
        close = [upper] if upper in known else difflib.get_close_matches(upper, list(known), n=1)
        hint = f"write {close[0]}" if close else "names are upper-case"
        raise ConfigError(
            f"environment variable names are case-sensitive: {name} is not read ({hint})",
            allowed="upper-case names: " + ", ".join(known),
            source=f"environment variable {name}",
        )
    warnings.warn(
        f"environment variable {name} is not read by rapidfire_hf: names are case-sensitive "
        f"(did you mean {upper}?)",
        stacklevel=3,
    )


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """The checked overrides set by ``RAPIDFIRE_<SECTION>_<KEY>`` variables, as ``{section: {key: value}}``.

    Args:
        environ: Variables to read (``os.environ`` when None).

    Raises:
        ConfigError: for a bad value or an unknown name under a section prefix, naming the variable.
    """
    environ = os.environ if environ is None else environ
    known = env_variables()
    prefixes = tuple(f"{ENV_PREFIX}{s}_".upper() for s in SECTIONS)
    overrides: dict[str, dict[str, Any]] = {}
    for name in sorted(environ):
        if not name.startswith(prefixes):
            _check_case(name, prefixes, known)
            continue
        source = f"environment variable {name}"
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError("unknown variable" + hint, allowed=", ".join(known), source=source)
        section, key = known[name]
        check = SECTIONS[section].field_check(key)
        try:
            value = check(f"{section}.{key}", check.parse_env(environ[name]))
        except ConfigError as err:
            raise err.with_source(source) from None
        overrides.setdefault(section, {})[key] = to_plain(value)
    return overrides


def explicit_settings(src: Any = None, *, env: bool = True) -> dict[str, tuple[Any, str | None]]:
    """The settings a config source gives by name, as ``{"section.field": (value, source)}``.

    What a preset fills in is not given by name (choosing ``aggressive`` chooses a memory level, not each
    of its values); keys written in the document's sections, the short-form keys and ``RAPIDFIRE_*``
    variables are. A ``RapidFireConfig`` object counts the fields that differ from the defaults.
    ``source`` names the environment variable, else None. The settings contract
    (``rapidfire_hf.config.contract``) refuses those an entry point does not apply.

    Raises:
        ConfigError: as :func:`load_config` does for a source it cannot read.
    """
    out: dict[str, tuple[Any, str | None]] = {}
    if isinstance(src, RapidFireConfig):
        given, default = src.to_dict(), RapidFireConfig().to_dict()
        for section, values in given.items():
            for key, value in values.items():
                if value != default[section][key]:
                    out[f"{section}.{key}"] = (value, None)
    elif src is not None:
        data, _ = _read_source(src)
        resolved = resolve(data)  # checks the keys
        for name in SECTIONS:
            value = data.get(name)
            if isinstance(value, Mapping):
                for key in value:
                    out[f"{name}.{key}"] = (resolved[name][key], None)
        if "gradient_pipeline" in data:
            out["gradient.pipeline"] = (resolved["gradient"]["pipeline"], None)
        if "memory_optimization" in data:
            out["memory.optimization"] = (resolved["memory"]["optimization"], None)
        if isinstance(data.get("precision"), str):
            out["precision.mode"] = (resolved["precision"]["mode"], None)
            if data["precision"] in {d.value for d in DType}:
                out["precision.initial"] = (resolved["precision"]["initial"], None)
    if env:
        names = {v: k for k, v in env_variables().items()}
        for section, values in env_overrides().items():
            for key, value in values.items():
                out[f"{section}.{key}"] = (value, f"environment variable {names[(section, key)]}")
    return {k: (to_plain(v), s) for k, (v, s) in out.items()}


def asked_dtype(src: Any = None, *, env: bool = True) -> tuple[str, str] | None:
    """``(dtype, where)`` when a config source asks for a compute precision by name: the short form
    ``precision: bf16`` (static, that dtype) or ``RAPIDFIRE_PRECISION_INITIAL``; None otherwise. A full-form
    ``precision.initial`` (a template such as ``config/advanced.yaml`` lists every key) is the plugin's
    starting point, not such a request."""
    if env and os.environ.get(f"{ENV_PREFIX}PRECISION_INITIAL"):
        return os.environ[f"{ENV_PREFIX}PRECISION_INITIAL"], f"environment variable {ENV_PREFIX}PRECISION_INITIAL"
    if src is None or isinstance(src, RapidFireConfig):
        return None
    data, _ = _read_source(src)
    value = data.get("precision")
    if isinstance(value, str) and value in {d.value for d in DType}:
        return value, f"precision: {value}"
    return None
