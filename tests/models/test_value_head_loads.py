"""``from_pretrained`` checks a saved value head before loading it (issue 30): a PEFT folder without its head
file, non-finite head tensors, index entries outside the folder, and wrong-shape, partial or extra head
tensors are refused with the file and tensor named; a healthy folder still loads bit-exactly."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from rapidfire_hf import AutoModelForCausalLMWithValueHead
from rapidfire_hf.demo import build_tiny_llama
from rapidfire_hf.models import ValueHeadLoadError

HIDDEN = 16
W, B = "v_head.summary.weight", "v_head.summary.bias"


@pytest.fixture()
def model(tokenizer):
    wrapper = AutoModelForCausalLMWithValueHead(build_tiny_llama(tokenizer, hidden=HIDDEN, layers=1))
    torch.manual_seed(1)
    torch.nn.init.normal_(wrapper.v_head.summary.weight)
    torch.nn.init.normal_(wrapper.v_head.summary.bias)
    return wrapper


@pytest.fixture()
def full_dir(model, tmp_path):
    path = tmp_path / "full"
    model.save_pretrained(path)
    return path


@pytest.fixture()
def peft_dir(model, tmp_path):
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], task_type="CAUSAL_LM")
    wrapper = AutoModelForCausalLMWithValueHead(get_peft_model(model.pretrained_model, lora))
    wrapper.v_head.load_state_dict(model.v_head.state_dict())
    wrapper.pretrained_model.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    wrapper.pretrained_model.get_base_model().save_pretrained(tmp_path / "base")
    path = tmp_path / "peft"
    wrapper.save_pretrained(path)
    return path


def _edit_safetensors(path, edit):
    state = load_file(path)
    edit(state)
    save_file(state, path, metadata={"format": "pt"})


def _edit_binary(path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)


def _load(path):
    return AutoModelForCausalLMWithValueHead.from_pretrained(path)


def test_healthy_folders_load_the_head_bit_exactly(model, full_dir, peft_dir, tmp_path):
    saved = {k: v.clone() for k, v in model.v_head.state_dict().items()}
    for path in (full_dir, peft_dir):
        loaded = _load(path).v_head.state_dict()
        assert loaded.keys() == saved.keys()
        for key in saved:
            assert torch.equal(loaded[key], saved[key]), (path, key)
    # a sharded .bin checkpoint (pytorch_model.bin.index.json) is read too, not replaced by a fresh head
    sharded = tmp_path / "bin_sharded"
    sharded.mkdir()
    for name in os.listdir(full_dir):
        if name != "model.safetensors":
            (sharded / name).write_bytes((full_dir / name).read_bytes())
    state = load_file(full_dir / "model.safetensors")
    head = {k: state.pop(k) for k in (W, B)}
    torch.save(state, sharded / "pytorch_model-00001-of-00002.bin")
    torch.save(head, sharded / "pytorch_model-00002-of-00002.bin")
    weight_map = {k: "pytorch_model-00001-of-00002.bin" for k in state}
    weight_map.update({k: "pytorch_model-00002-of-00002.bin" for k in head})
    (sharded / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    loaded = _load(sharded).v_head.state_dict()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def test_peft_folder_without_its_head_file_is_refused(peft_dir):
    os.remove(peft_dir / "pytorch_model.bin")
    with pytest.raises(ValueHeadLoadError) as err:
        _load(peft_dir)
    message = str(err.value)
    assert str(peft_dir) in message and "pytorch_model.bin" in message and "PEFT adapter folder" in message
    assert "peft.PeftModel.from_pretrained" in message  # the fix for a new head
    # a head file that holds no v_head.* tensors is the same case
    torch.save({"other": torch.zeros(1)}, peft_dir / "pytorch_model.bin")
    with pytest.raises(ValueHeadLoadError, match="holds no v_head"):
        _load(peft_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_head_weights_are_refused(full_dir, peft_dir, bad):
    def poison(state):
        state[B] = torch.full_like(state[B], bad)

    _edit_safetensors(full_dir / "model.safetensors", poison)
    with pytest.raises(ValueHeadLoadError, match=r"model\.safetensors: v_head\.summary\.bias holds"):
        _load(full_dir)
    _edit_binary(peft_dir / "pytorch_model.bin", poison)
    with pytest.raises(ValueHeadLoadError, match=r"pytorch_model\.bin: v_head\.summary\.bias holds"):
        _load(peft_dir)


@pytest.mark.parametrize("where", ["parent", "absolute"])
@pytest.mark.parametrize("index", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
def test_index_naming_a_shard_outside_the_folder_is_refused(full_dir, tmp_path, where, index):
    outside = tmp_path / ("x.safetensors" if index.startswith("model") else "x.bin")
    if index.startswith("model"):
        save_file({W: torch.zeros(1, HIDDEN), B: torch.zeros(1)}, outside, metadata={"format": "pt"})
    else:
        torch.save({W: torch.zeros(1, HIDDEN), B: torch.zeros(1)}, outside)
    name = f"../{outside.name}" if where == "parent" else str(outside)
    shard = "model.safetensors"
    if index.startswith("pytorch"):  # a .bin checkpoint: its shard instead of model.safetensors
        shard = "pytorch_model-00001-of-00001.bin"
        torch.save(load_file(full_dir / "model.safetensors"), full_dir / shard)
        os.remove(full_dir / "model.safetensors")
    keys = load_file(full_dir / shard) if shard.endswith(".safetensors") else torch.load(full_dir / shard)
    weight_map = dict.fromkeys(keys, shard)
    weight_map[W] = name
    (full_dir / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueHeadLoadError) as err:
        _load(full_dir)
    message = str(err.value)
    assert str(full_dir / index) in message and repr(name) in message and W in message
    assert "inside" in message


def test_wrong_shape_head_tensor_is_refused(full_dir):
    _edit_safetensors(full_dir / "model.safetensors", lambda s: s.update({W: torch.zeros(1, HIDDEN + 1)}))
    with pytest.raises(ValueHeadLoadError) as err:
        _load(full_dir)
    message = str(err.value)
    assert str(full_dir / "model.safetensors") in message and W in message
    assert f"(1, {HIDDEN + 1})" in message and f"expects (1, {HIDDEN})" in message


@pytest.mark.parametrize("dropped", [W, B])
def test_partial_head_is_refused(peft_dir, dropped):
    _edit_binary(peft_dir / "pytorch_model.bin", lambda s: s.pop(dropped))
    with pytest.raises(ValueHeadLoadError) as err:
        _load(peft_dir)
    message = str(err.value)
    assert str(peft_dir / "pytorch_model.bin") in message and f"{dropped} missing" in message


def test_extra_head_tensor_is_refused(full_dir):
    _edit_safetensors(
        full_dir / "model.safetensors", lambda s: s.update({"v_head.extra.weight": torch.ones(2)})
    )
    with pytest.raises(ValueHeadLoadError) as err:
        _load(full_dir)
    message = str(err.value)
    assert str(full_dir / "model.safetensors") in message and "v_head.extra.weight" in message
    assert isinstance(err.value, ValueError)
