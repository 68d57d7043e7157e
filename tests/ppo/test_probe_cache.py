"""The plan's probe cache is used only when verifiably this setup's, and says so (ppo/recipe/probe_cache.py).

Attacks on ``<output_dir>/rapidfire_plan_probe.json`` after a real trainer measured and stored its probe:
numbers edited by hand, numbers forged with the check recomputed, an entry moved under another setup's key,
an entry measured under another torch version, garbage. Each is refused with one warning naming why, and
the probe is measured again; a verified entry is used and the plan table says it was cached.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rapidfire_hf.ppo.recipe.planning import measure, policies, probe_identity, shape_estimate
from rapidfire_hf.ppo.recipe.probe_cache import PROBE_CACHE, ProbeCache, _seal, identity_key
from tests.ppo.helpers import tiny_trainer

CFG = {"memory": {"prefetch_window": 0}, "gradient": {"pipeline": False}, "precision": {"mode": "static"}}


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Single-threaded: the tiny models are faster that way on the shared cores."""


@pytest.fixture
def trainer(tmp_path, tokenizer):
    torch.manual_seed(0)
    return tiny_trainer(tmp_path, tokenizer, rapidfire_config=CFG)


def probe(trainer, tokens=14, ctx=8):
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    models = [m for m in (unwrapped.policy, unwrapped.value_model) if m is not None]
    wanted = policies(trainer.rf_config.memory, "auto")
    return measure(trainer.plan_inputs(), models, tokens, ctx, wanted), wanted


def rewrite(path, change):
    data = json.loads(path.read_text())
    ((key, entry),) = data["entries"].items()
    key, entry = change(key, entry)
    data["entries"] = {key: entry}
    path.write_text(json.dumps(data))


def test_a_verified_entry_is_used_and_said(trainer, capsys):
    first, _ = probe(trainer)
    second, _ = probe(trainer)
    assert not first.cached and second.cached and second.activation_bytes == first.activation_bytes
    assert "cached in" in second.source and "(verified)" in second.source
    queries = trainer.next_prompts(0)["input_ids"]
    trainer.plan_update(queries)  # measures this row length and stores it
    assert "activation bytes per training row" not in capsys.readouterr().out  # measured: nothing to say
    trainer.plan_update(queries)
    assert "activation bytes per training row: cached in" in capsys.readouterr().out


def test_the_tiny_models_probe_is_within_the_plausible_range_of_its_estimate(trainer):
    measured, wanted = probe(trainer)
    estimate = shape_estimate(trainer.plan_inputs(), 14, 8, 4, wanted)
    for policy, nbytes in measured.activation_bytes.items():
        assert estimate[policy] / 4 <= nbytes <= estimate[policy] * 4, (policy, nbytes, estimate[policy])


def _measured_again(trainer, caplog, why):
    with caplog.at_level(logging.WARNING):
        again, _ = probe(trainer)
    assert not again.cached
    assert "not using the plan's probe cache" in caplog.text and why in caplog.text, caplog.text
    return again


def test_numbers_edited_by_hand_are_refused(trainer, caplog):
    first, _ = probe(trainer)

    def halve(key, entry):
        entry["bytes"] = {p: v // 2 for p, v in entry["bytes"].items()}
        return key, entry

    rewrite(_path(trainer), halve)
    again = _measured_again(trainer, caplog, "was edited")
    assert again.activation_bytes == first.activation_bytes


def _path(trainer):
    from pathlib import Path

    return Path(trainer.args.output_dir) / PROBE_CACHE


def test_forged_numbers_with_a_recomputed_check_are_refused_as_implausible(trainer, caplog):
    probe(trainer)

    def forge(key, entry):
        entry["bytes"] = {p: 1 for p in entry["bytes"]}  # one byte a row: every plan would merge everything
        entry["check"] = _seal(entry["identity"], entry["bytes"])
        return key, entry

    rewrite(_path(trainer), forge)
    _measured_again(trainer, caplog, "implausible")


def test_an_entry_moved_under_another_setups_key_is_refused(trainer, caplog):
    probe(trainer)

    def other_setup(key, entry):
        entry["identity"] = {**entry["identity"], "device": "NVIDIA H200"}  # measured elsewhere
        entry["check"] = _seal(entry["identity"], entry["bytes"])
        return key, entry  # ... but left under this setup's key

    rewrite(_path(trainer), other_setup)
    _measured_again(trainer, caplog, "not the setup its key names")


def test_a_stale_entry_is_said_measured_again_and_replaced(trainer, caplog):
    probe(trainer)

    def older(key, entry):
        entry["identity"] = {**entry["identity"], "torch": "2.0.0"}
        entry["check"] = _seal(entry["identity"], entry["bytes"])
        return identity_key(entry["identity"]), entry

    rewrite(_path(trainer), older)
    _measured_again(trainer, caplog, "stale: this setup was measured with torch 2.0.0")
    entries = json.loads(_path(trainer).read_text())["entries"]
    assert len(entries) == 1 and next(iter(entries.values()))["identity"]["torch"] == torch.__version__


@pytest.mark.parametrize("garbage", [b"\xff\x00 not json", b"[1, 2]", b'{"version": 2, "entries": 7}',
                                     b"[" * 100000, b""])  # fmt: skip
def test_garbage_is_ignored_with_a_warning(trainer, caplog, garbage):
    probe(trainer)
    _path(trainer).write_bytes(garbage)
    with caplog.at_level(logging.WARNING):
        again, _ = probe(trainer)
    assert not again.cached


def test_identity_names_the_versions_and_the_device(trainer):
    identity = probe_identity(trainer.plan_inputs(), 14, ("none",))
    assert identity["torch"] == torch.__version__ and identity["device"] == "cpu"
    assert {"transformers", "rapidfire_hf", "config", "tokens", "policies"} <= set(identity)
    assert ProbeCache(trainer.args.output_dir).get(identity, ("none",)) is None  # nothing stored yet
