"""models.plumbing: where a causal LM's and a sequence classifier's pieces are, PEFT-wrapped or not."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from rapidfire_hf.models.plumbing import causal_lm_parts, classifier_parts, decoder_layers, final_norm

CONFIG = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    pad_token_id=0,
)


def test_classifier_parts_are_the_backbone_and_score_head():
    model = LlamaForSequenceClassification(LlamaConfig(**CONFIG, num_labels=1))
    backbone, score = classifier_parts(model, "reward_model")
    assert backbone is model.model and score is model.score
    ids = torch.tensor([[1, 5, 7, 9]])
    hidden = backbone(input_ids=ids).last_hidden_state
    # the head on the last position's hidden state is the classifier's own output for an unpadded row
    torch.testing.assert_close(score(hidden)[:, -1], model(input_ids=ids).logits, rtol=0, atol=0)


def test_classifier_parts_name_the_role_for_a_model_without_a_score_head():
    with pytest.raises(
        TypeError, match=r"value_model \(LlamaForCausalLM\) must be .* sequence-classification"
    ):
        classifier_parts(LlamaForCausalLM(LlamaConfig(**CONFIG)), "value_model")


def test_causal_lm_pieces_under_peft():
    peft = pytest.importorskip("peft")
    base = LlamaForCausalLM(LlamaConfig(**CONFIG))
    wrapped = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert decoder_layers(wrapped) is base.model.layers and final_norm(wrapped) is base.model.norm
    decoder, head = causal_lm_parts(wrapped)
    assert decoder is base.model and head is base.lm_head
