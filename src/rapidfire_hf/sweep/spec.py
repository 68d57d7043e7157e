"""A sweep described in YAML (``rapidfire sweep SWEEP.yaml``): shared settings plus a ``trials:`` mapping.

.. code-block:: yaml

    model: demo                 # the embedded tiny Llama, or a local path of a HF causal LM
    dataset: demo               # the embedded prompts, or a .json/.jsonl/.csv file or a save_to_disk folder
    reward_funcs: [demo]        # "demo" (the vowel reward) or "package.module:function"
    # reward_model: path        # instead of reward_funcs: a local sequence-classification model
    lora: {r: 8, lora_alpha: 16, target_modules: [q_proj, v_proj]}
    config:                     # PPOConfig fields shared by every trial
      output_dir: out/sweep
      max_steps: 40
    trials:
      kl0.01: {kl_coef: 0.01}
      kl0.2: {kl_coef: 0.2, learning_rate: 2.0e-5}
    early_stopping: {metric: objective/scores, after_updates: 10, margin: 0.1}
    # successive_halving: {rungs: [5, 10, 20], keep: 0.5, metric: objective/scores}
    # train_rows_per_forward: 16  # rows of one training forward across trials (default: 16,384 tokens)

Every key and value is checked before anything loads: an unknown key, a key given twice, an unknown
PPOConfig field in ``config`` or a trial, a field trials must share, a value PPOConfig refuses, a trial
name that cannot be a folder name, a LoRA setting peft refuses, a reward function that is not a
``"module:function"`` string, or a stopping rule's bad value raises a ``ConfigError`` naming it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
from pathlib import Path
from typing import Any

from rapidfire_hf.config.errors import ConfigError

KEYS = (
    "model",
    "dataset",
    "reward_funcs",
    "reward_model",
    "lora",
    "config",
    "trials",
    "early_stopping",
    "successive_halving",
    "train_rows_per_forward",
)
DEFAULT_LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}


# where the keys of a long list are written down (the error names the closest key and points here)
CONFIG_KEYS = (
    "a field of rapidfire_hf.PPOConfig "
    "(python -c 'import rapidfire_hf; help(rapidfire_hf.PPOConfig)' lists them)"
)
TRIAL_KEYS = "a field of rapidfire_hf.sweep.PER_TRIAL_FIELDS (docs/sweep.md, 'What a trial owns', lists them)"


def _unknown(key: str, known, where: str, listed: str | None = None) -> ConfigError:
    """``where.key: unknown key (did you mean closest?)`` plus the valid keys, or where they are listed."""
    close = difflib.get_close_matches(str(key), list(known), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    allowed = listed or ", ".join(sorted(known))
    return ConfigError(f"unknown key{hint}", key=f"{where}{key}", allowed=allowed)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__


def _mapping(data: dict, key: str) -> dict:
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError("must be a mapping", key=key, value=value)
    return value


def _check_paths_and_funcs(data: dict) -> None:
    for key in ("model", "dataset", "reward_model"):
        if key in data and (not isinstance(data[key], str) or not data[key]):
            raise ConfigError("must be a string: 'demo' or a local path", key=key, value=data[key])
    if ("reward_funcs" in data) == ("reward_model" in data):
        raise ConfigError("give exactly one of reward_funcs and reward_model", key="reward_funcs")
    if "reward_funcs" in data:
        funcs = data["reward_funcs"]
        names = funcs if isinstance(funcs, list) else [funcs]
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(
                "must be 'demo', 'package.module:function' or a list of them", key="reward_funcs", value=funcs
            )


def _check_lora(data: dict) -> None:
    lora = _mapping(data, "lora")
    if not lora:
        return
    from peft import LoraConfig

    try:
        config = LoraConfig(**lora)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"peft's LoraConfig refuses it ({_one_line(err)})", key="lora", value=lora
        ) from None
    if not isinstance(config.r, int) or isinstance(config.r, bool) or config.r < 1:
        raise ConfigError("r must be an integer >= 1", key="lora.r", value=config.r)


def _check_trials(data: dict):
    from rapidfire_hf.ppo.config import PPOConfig
    from rapidfire_hf.sweep.fields import PER_TRIAL_FIELDS, check_trial_name
    from rapidfire_hf.sweep.trial import trial_args

    trials = data.get("trials")
    if not isinstance(trials, dict) or not trials:
        raise ConfigError("needs a mapping of trial name -> overrides", key="trials", value=trials)
    ppo_fields = {f.name for f in dataclasses.fields(PPOConfig) if f.init}
    config = _mapping(data, "config")
    for key in config:
        if key not in ppo_fields:
            raise _unknown(key, ppo_fields, "config.", CONFIG_KEYS)
    try:
        shared = PPOConfig(**{"report_to": [], "output_dir": "rapidfire_sweep", **config})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"PPOConfig refuses it ({_one_line(err)})", key="config") from None
    if config.get("rapidfire_config") is not None:  # the plan's memory level: checked before the model loads
        from rapidfire_hf.config.loader import load_config

        try:  # first, so a bad file or preset is named as this key rather than met by the contract's reader
            load_config(config["rapidfire_config"])
        except ConfigError as err:
            raise ConfigError(_one_line(err), key="config.rapidfire_config") from None
    from rapidfire_hf.ppo.settings_check import check_sweep_settings

    check_sweep_settings(shared)  # the settings contract: what a sweep does not apply, refused before any load
    for name, overrides in trials.items():
        try:
            check_trial_name(name)
        except ValueError as err:
            raise ConfigError(_one_line(err), key="trials") from None
        if not isinstance(overrides, dict | None):
            raise ConfigError("must be a mapping of PPOConfig fields", key=f"trials.{name}", value=overrides)
        for key in overrides or {}:
            if key not in ppo_fields:
                raise _unknown(key, PER_TRIAL_FIELDS, f"trials.{name}.", TRIAL_KEYS)
            if key not in PER_TRIAL_FIELDS:
                raise ConfigError(
                    "is shared by every trial (one batched decode): set it under config",
                    key=f"trials.{name}.{key}",
                    allowed=TRIAL_KEYS,
                )
        try:
            trial_args(shared, overrides or {}, name)
        except ValueError as err:
            raise ConfigError(_one_line(err), key=f"trials.{name}") from None


def _check_rules(data: dict) -> None:
    from rapidfire_hf.sweep.control import EarlyStopping, SuccessiveHalving

    for key, rule in (("early_stopping", EarlyStopping), ("successive_halving", SuccessiveHalving)):
        values = _mapping(data, key)
        known = {f.name for f in dataclasses.fields(rule) if f.init}
        for field_name in values:
            if field_name not in known:
                raise _unknown(field_name, known, f"{key}.")
        try:
            rule(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
        except (TypeError, ValueError) as err:
            raise ConfigError(_one_line(err), key=key, value=values) from None


def validate(data: dict, source: str | None = None) -> dict:
    """Check a sweep document; returns it with defaults filled in. Raises ConfigError naming the key."""
    try:
        for key in data:
            if key not in KEYS:
                raise _unknown(key, KEYS, "")
        _check_trials(data)
        _check_paths_and_funcs(data)
        _check_lora(data)
        _check_rules(data)
        rows = data.get("train_rows_per_forward")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise ConfigError(
                "must be a whole number >= 1",
                key="train_rows_per_forward",
                value=rows,
                allowed="rows of one training forward across the trials of a micro-step (omit: 16,384 tokens)",
            )
    except ConfigError as err:
        raise (err.with_source(source) if source else err) from None
    return {"model": "demo", "dataset": "demo", "lora": DEFAULT_LORA, **data}


def _unique_key_loader():
    """A yaml SafeLoader that refuses a mapping with the same key twice (PyYAML keeps the last silently)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    def construct_mapping(loader, node, deep=False):
        loader.flatten_mapping(node)
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the default constructor reports it
                break
            if duplicate:
                raise ConfigError(
                    f"is given twice (line {key_node.start_mark.line + 1}); each key once",
                    key=str(key),
                )
            seen.add(key)
        return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return UniqueKeyLoader


def load_spec(path: str | Path) -> dict:
    """Read and validate a sweep YAML file (a key given twice is an error, not the last one winning)."""
    import yaml

    from rapidfire_hf.config.loader import MAX_DOCUMENT_VALUES, count_values

    if not Path(path).is_file():
        raise ConfigError(
            "sweep file not found", value=str(path), allowed="the path of a sweep YAML file (docs/sweep.md)"
        )
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_unique_key_loader())  # noqa: S506
    except ConfigError as err:
        raise err.with_source(str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML: {err}", source=str(path)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the file: {err}", source=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("the file must hold a mapping of sweep keys", value=data, source=str(path))
    if count_values(data, MAX_DOCUMENT_VALUES) > MAX_DOCUMENT_VALUES:
        raise ConfigError("the document expands to too many values (nested YAML aliases?)", source=str(path))
    return validate(data, source=str(path))


def _reward_func(name: str):
    if name == "demo":
        from rapidfire_hf.demo import vowel_reward

        return vowel_reward
    module, _, attr = str(name).partition(":")
    allowed = "'demo' or 'package.module:function', importable from the current folder or PYTHONPATH"
    if not module or not attr:
        raise ConfigError("must be 'demo' or 'package.module:function'", key="reward_funcs", value=name)
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` does: ./mymod.py imports
        sys.path.insert(0, os.getcwd())
    try:
        func = getattr(importlib.import_module(module), attr)
    except ImportError as err:
        raise ConfigError(f"cannot import module {module!r} ({err})", key="reward_funcs", value=name,
                          allowed=allowed) from None  # fmt: skip
    except AttributeError:
        raise ConfigError(f"module {module!r} has no {attr!r}", key="reward_funcs", value=name,
                          allowed=allowed) from None  # fmt: skip
    if not callable(func):
        raise ConfigError(f"{module}.{attr} is not a function", key="reward_funcs", value=name)
    return func


def _dataset(src: str, seed: int):
    from rapidfire_hf.demo import make_prompt_dataset

    if src == "demo":
        return make_prompt_dataset(512, seed=seed)
    path = Path(src)
    if not path.exists():
        raise ConfigError("no such local file or folder", key="dataset", value=src)
    import datasets

    if path.is_dir():
        return datasets.load_from_disk(str(path))
    kind = {".json": "json", ".jsonl": "json", ".csv": "csv"}.get(path.suffix)
    if kind is None:
        raise ConfigError(
            "unknown dataset file type", key="dataset", value=src, allowed=".json, .jsonl, .csv"
        )
    return datasets.load_dataset(kind, data_files=str(path), split="train")


def build(spec: dict, progress: bool = True, callbacks=None):
    """A :class:`PPOSweep` from a validated spec (models loaded from local paths only)."""
    from peft import LoraConfig

    from rapidfire_hf.ppo.config import PPOConfig
    from rapidfire_hf.sweep import EarlyStopping, PPOSweep

    funcs = None
    if "reward_model" not in spec:  # a reward function that does not import fails before any model loads
        names = spec["reward_funcs"] if isinstance(spec["reward_funcs"], list) else [spec["reward_funcs"]]
        funcs = [_reward_func(n) for n in names]
    config: dict[str, Any] = {"report_to": [], **(spec.get("config") or {})}
    config.setdefault("output_dir", "rapidfire_sweep")
    args = PPOConfig(**config)
    if spec["model"] == "demo":
        from rapidfire_hf.demo import DemoTask

        tok, model, _, _ = DemoTask(seed=args.seed).build()
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not Path(spec["model"]).exists():
            raise ConfigError(
                "no such local path (sweeps never download models)", key="model", value=spec["model"]
            )
        tok = AutoTokenizer.from_pretrained(spec["model"])
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(spec["model"])
    reward_model = None
    if "reward_model" in spec:
        from transformers import AutoModelForSequenceClassification

        reward_model = AutoModelForSequenceClassification.from_pretrained(spec["reward_model"])
    from rapidfire_hf.sweep.control import SuccessiveHalving

    rules = []
    if spec.get("early_stopping"):
        rules.append(EarlyStopping(**spec["early_stopping"]))
    if spec.get("successive_halving"):
        halving = spec["successive_halving"]
        rules.append(
            SuccessiveHalving(**{k: tuple(v) if isinstance(v, list) else v for k, v in halving.items()})
        )
    return PPOSweep(
        args=args,
        trials={n: dict(o or {}) for n, o in spec["trials"].items()},
        model=model,
        processing_class=tok,
        train_dataset=_dataset(spec["dataset"], args.seed),
        peft_config=LoraConfig(**spec["lora"]),
        reward_funcs=funcs,
        reward_model=reward_model,
        callbacks=callbacks,
        early_stopping=rules,
        progress=progress,
        train_rows_per_forward=spec.get("train_rows_per_forward"),
    )
