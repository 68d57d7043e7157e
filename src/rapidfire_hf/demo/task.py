"""Builders for the demo task and the test-suite's tiny models.

The task: prompts are short random lowercase words ("task: zqkt ->"); the reward counts the vowels
the response writes (up to 8, scaled to [0, 1]), minus a penalty when the response has no EOS. A
random-init policy emits a vowel about once in nine tokens, so the reward starts near 0.1; PPO raises
it visibly within a few dozen updates of a tiny model on a CPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import NamedTuple

import torch

VOWELS = frozenset("aeiou")
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"
_SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
_PUNCT = [" ", ":", "-", ">", ".", ","]


def wordlevel_tokenizer(vocab: dict[str, int], pre_tokenizer, decoder=None):
    """A left-padding ``PreTrainedTokenizerFast`` over a fixed vocabulary (no download).

    ``vocab`` must hold the specials ``<pad>``, ``<s>``, ``</s>`` and ``<unk>``; ``pre_tokenizer`` (and
    ``decoder``) come from the ``tokenizers`` library.
    """
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        core.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )


def build_char_tokenizer(vocab_size: int | None = None):
    """A character-level ``PreTrainedTokenizerFast`` built in code (no download).

    Vocabulary: 4 specials (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3), 26 lowercase letters,
    6 punctuation characters and 10 digits; ``vocab_size`` pads it with filler tokens ``<|i|>`` (for
    benchmarks that need a model-sized vocabulary). Saved/loaded with ``save_pretrained`` like any HF
    tokenizer.
    """
    from tokenizers import decoders, pre_tokenizers

    chars = list(_ALPHABET) + _PUNCT + [str(d) for d in range(10)]
    vocab = {tok: i for i, tok in enumerate(_SPECIALS + chars)}
    if vocab_size is not None:
        vocab.update({f"<|{i}|>": i for i in range(len(vocab), vocab_size)})
    return wordlevel_tokenizer(vocab, pre_tokenizers.Split(pattern="", behavior="isolated"), decoders.Fuse())


def _llama_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=kw.pop("max_position_embeddings", 256),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=kw.pop("tie_word_embeddings", False),
        **kw,
    )


def build_tiny_llama(
    tokenizer=None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **config_kwargs,
):
    """A random-init ``LlamaForCausalLM`` (GQA when ``kv_heads < heads``) sized for CPU tests."""
    from transformers import LlamaForCausalLM

    vocab = len(tokenizer) if tokenizer is not None else 46
    torch.manual_seed(seed)
    model = LlamaForCausalLM(_llama_config(vocab, hidden, layers, heads, kv_heads, **config_kwargs))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model.to(dtype)


def build_tiny_value_model(
    tokenizer=None,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    seed: int = 1,
    num_labels: int = 1,
):
    """A random-init ``LlamaForSequenceClassification`` with one label: a value or reward model."""
    from transformers import LlamaForSequenceClassification

    vocab = len(tokenizer) if tokenizer is not None else 46
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(
        _llama_config(vocab, hidden, layers, heads, kv_heads, num_labels=num_labels)
    )


build_tiny_reward_model = build_tiny_value_model


def make_prompt_dataset(n: int = 256, seed: int = 0, min_len: int = 3, max_len: int = 6):
    """A ``datasets.Dataset`` with a ``prompt`` text column of random words of mixed lengths."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        word = "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(min_len, max_len)))
        prompts.append(f"task: {word} ->")
    return Dataset.from_dict({"prompt": prompts})


def vowel_reward(completions: list[str], target: int = 8, **kwargs) -> list[float]:
    """Vowels in each completion, counted up to ``target``, divided by ``target`` (so in [0, 1]).

    A reward function in the style of TRL's ``reward_funcs``: takes the decoded completions (and any
    dataset columns as keyword arguments) and returns one float per completion. Counting (rather than
    a vowel fraction) rewards completions that keep writing vowels instead of stopping at once.
    """
    return [min(sum(c in VOWELS for c in text), target) / target for text in completions]


@dataclass
class DemoTask:
    """Everything `rapidfire demo` trains: sizes chosen so that it finishes in minutes on 2 CPU cores."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    num_prompts: int = 512
    seed: int = 0

    def build(self):
        tok = build_char_tokenizer()
        policy = build_tiny_llama(tok, self.hidden, self.layers, self.heads, self.kv_heads, seed=self.seed)
        value = build_tiny_value_model(
            tok, self.hidden, self.layers, self.heads, self.kv_heads, seed=self.seed + 1
        )
        dataset = make_prompt_dataset(self.num_prompts, seed=self.seed)
        return tok, policy, value, dataset


class TinySetup(NamedTuple):
    """What :func:`tiny_setup` returns; unpacks as ``tokenizer, policy, value_model, reward, dataset``."""

    tokenizer: object
    policy: torch.nn.Module
    value_model: torch.nn.Module
    reward: object
    dataset: object


def tiny_setup(num_prompts: int = 64, seed: int = 0) -> TinySetup:
    """Stand-ins for your own models and data, to run the README and docs snippets on a CPU in seconds.

    Nothing is downloaded: a character tokenizer built in code (:func:`build_char_tokenizer`), a random-init
    2-layer Llama policy (:func:`build_tiny_llama`), a value model of the same shape
    (:func:`build_tiny_value_model`), the rule-based reward :func:`vowel_reward` (a ``reward_funcs`` entry)
    and ``num_prompts`` prompts in a ``prompt`` column (:func:`make_prompt_dataset`).

    Example:
        >>> tokenizer, policy, value_model, reward, prompts = tiny_setup(num_prompts=8)
        >>> len(prompts), reward(["aeiou"])
        (8, [0.625])
    """
    tokenizer = build_char_tokenizer()
    policy = build_tiny_llama(tokenizer, seed=seed)
    value_model = build_tiny_value_model(tokenizer, seed=seed + 1)
    return TinySetup(
        tokenizer, policy, value_model, vowel_reward, make_prompt_dataset(num_prompts, seed=seed)
    )
