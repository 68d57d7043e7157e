"""Prompt data for PPO: validation, tokenization, a deterministic resumable batch order, left-padding."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from rapidfire_hf.config.errors import quote


def prepare_prompt_dataset(
    dataset,
    tokenizer,
    text_field: str = "prompt",
    max_prompt_length: int | None = None,
    *,
    name: str = "train_dataset",
    vocab_size: int | None = None,
    max_length: int | None = None,
    num_proc: int | None = None,
):
    """Return ``dataset`` with an ``input_ids`` column (tokenizing ``text_field`` when needed), checked.

    A conversational prompt (a list of ``{"role", "content"}`` messages) goes through the tokenizer's chat
    template with the generation prompt added, as TRL's trainers do.

    Args:
        dataset: a ``datasets.Dataset``; a list of dicts (rows), a list of strings (prompts) or a dict of
            columns is converted to one.
        name: how errors name the dataset (``train_dataset``, ``eval_dataset``).
        num_proc: processes for tokenizing (``datasets.Dataset.map``); None tokenizes in this process.
        vocab_size: token ids must be below this (the policy's embedding rows); None: not checked.
        max_length: the longest prompt allowed, in tokens (the model's positions minus the response
            length); None: not checked.

    Raises:
        TypeError: ``dataset`` is none of the accepted types, or a prompt is not text / token ids.
        ValueError: the dataset is empty, has neither ``input_ids`` nor the text column, or holds an empty
            prompt, a token id outside ``[0, vocab_size)`` or a prompt longer than ``max_length``.
    """
    if dataset is None:
        raise ValueError(
            f"PPOTrainer needs a {name} of prompts (a `{text_field}` text column or `input_ids`)."
        )
    dataset = as_dataset(dataset, name, text_field)
    columns = list(dataset.column_names)
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: PPO needs at least one prompt per rollout batch.")
    if "input_ids" not in columns:
        if text_field not in columns:
            raise ValueError(
                f"{name} has no prompt column: expected a '{text_field}' text column or an 'input_ids' "
                f"column, found {columns}. Rename your prompt column to '{text_field}' or set "
                "PPOConfig(dataset_text_field=...)."
            )
        texts = dataset[text_field]
        chat = bool(texts) and all(is_conversation(t) for t in texts)
        if chat and getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"{name}: '{text_field}' holds chat messages but the tokenizer has no chat_template: set "
                "tokenizer.chat_template, or give the prompts as text"
            )
        if not chat:
            _check_texts(texts, name, text_field)

        def tokenize(row):
            if chat:
                ids = tokenizer.apply_chat_template(
                    row[text_field], add_generation_prompt=True, tokenize=True
                )
                return {"input_ids": list(ids["input_ids"] if isinstance(ids, Mapping) else ids)}
            return {"input_ids": tokenizer(row[text_field], add_special_tokens=True)["input_ids"]}

        dataset = dataset.map(tokenize, desc="Tokenizing prompts", num_proc=num_proc)
    if max_prompt_length is not None:
        dataset = dataset.map(lambda row: {"input_ids": row["input_ids"][-max_prompt_length:]})
    check_prompt_ids(dataset, name, vocab_size, max_length)
    return dataset


def as_dataset(data, name: str = "train_dataset", text_field: str = "prompt"):
    """``data`` as a ``datasets.Dataset``: a Dataset as is; a list of row dicts, a list of prompt strings
    (put in ``text_field``) or a dict of equal-length columns converted.

    Raises:
        TypeError: for anything else (a ``DatasetDict`` names its splits; an ``IterableDataset`` has no
            length, which the seeded batch order needs).
    """
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(data, Dataset):
        return data
    if isinstance(data, (DatasetDict, IterableDatasetDict)):
        raise TypeError(
            f"{name} is a {type(data).__name__} with splits {list(data)}: pass one split, e.g. "
            f"{name}=dataset[{next(iter(data), 'train')!r}]"
        )
    if isinstance(data, IterableDataset):
        raise TypeError(
            f"{name} is an IterableDataset: PPO draws a seeded permutation of the prompts, so it needs a "
            "datasets.Dataset with a length (e.g. Dataset.from_generator or load_dataset without streaming)"
        )
    allowed = (
        "a datasets.Dataset, a list of row dicts, a list of prompt strings or a dict of equal-length columns"
    )
    if isinstance(data, dict):
        lengths = {k: len(v) if isinstance(v, (list, tuple)) else None for k, v in data.items()}
        if not data or None in lengths.values() or len(set(lengths.values())) != 1:
            raise TypeError(
                f"{name} is a dict but not of equal-length column lists ({lengths}); expected {allowed}"
            )
        return Dataset.from_dict({k: list(v) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        if all(isinstance(row, str) for row in data):
            return Dataset.from_dict({text_field: list(data)})
        if all(isinstance(row, dict) for row in data):
            return Dataset.from_list(list(data))
        kinds = sorted({type(row).__name__ for row in data})
        raise TypeError(f"{name} is a list of {', '.join(kinds)}; expected {allowed}")
    raise TypeError(f"{name} is a {type(data).__name__}; expected {allowed}")


def is_conversation(value) -> bool:
    """Whether ``value`` is a list of chat messages (dicts with ``role`` and ``content``)."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def _check_texts(texts: list, name: str, text_field: str) -> None:
    for row, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(
                f"{name} row {row}: '{text_field}' is {quote(text)} ({type(text).__name__}); expected a "
                "prompt string"
            )
        if not text:
            raise ValueError(
                f"{name} row {row}: '{text_field}' is an empty string; every prompt needs at least one token"
            )


def check_prompt_ids(
    dataset, name: str = "train_dataset", vocab_size: int | None = None, max_length: int | None = None
) -> None:
    """Check every row's ``input_ids``: a non-empty list of integer ids in ``[0, vocab_size)``, at most
    ``max_length`` long. One pass over the Arrow column (no Python loop over tokens).

    Raises:
        TypeError: the column does not hold lists of integers.
        ValueError: naming the first offending row, its length or token id, and the bound.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")[:]["input_ids"]
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not (
        pa.types.is_integer(kind.value_type) or pa.types.is_null(kind.value_type)
    ):
        raise TypeError(
            f"{name}: 'input_ids' holds {kind}; expected lists of integer token ids, one per prompt"
        )
    if column.null_count:
        raise ValueError(f"{name} row {column.is_null().index(True).as_py()}: 'input_ids' is missing (None)")
    lengths = np.asarray(pc.list_value_length(column), dtype=np.int64)
    empty = np.flatnonzero(lengths == 0)
    if empty.size:
        raise ValueError(
            f"{name} row {empty[0]}: 'input_ids' is empty; every prompt needs at least one token"
        )
    if max_length is not None and lengths.max() > max_length:
        row = int(np.argmax(lengths > max_length))
        raise ValueError(
            f"{name} row {row}: the prompt has {lengths[row]} tokens, more than the {max_length} the model's "
            "positions leave beside the response (max_position_embeddings - response_length): set "
            "PPOConfig(max_prompt_length=...) or shorten the prompts"
        )
    if vocab_size is None:
        return
    ids = np.asarray(pc.list_flatten(column).fill_null(0), dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
        raise ValueError(
            f"{name} row {row}: token id {ids[bad[0]]} is outside the model's vocabulary [0, {vocab_size}): "
            "was the dataset tokenized with another tokenizer?"
        )


def prompt_limits(model, response_length: int) -> dict[str, int | None]:
    """``vocab_size`` (input embedding rows) and ``max_length`` (positions left for the prompt) of ``model``
    for :func:`prepare_prompt_dataset`; None for what the model does not say."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab_size = getattr(embeddings, "num_embeddings", None)
    config = getattr(model, "config", None)
    positions = None
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            positions = value
            break
    if positions is not None and positions <= response_length:
        raise ValueError(
            f"response_length={response_length} leaves no room for a prompt in the model's "
            f"{positions} positions (max_position_embeddings): lower response_length"
        )
    return {
        "vocab_size": vocab_size,
        "max_length": None if positions is None else positions - response_length,
    }


@dataclass
class PromptOrder:
    """Which prompts each rollout batch takes: a fresh seeded permutation per pass over the data.

    The order depends only on ``(seed, batch index)``, so a resumed run continues with exactly the
    batches it would have seen. Each rank takes its own slice of the global batch; a pass drops the
    last incomplete global batch (as TRL's ``drop_last=True``).
    """

    num_rows: int
    global_batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        if self.global_batch_size < 1 or self.world_size < 1:
            raise ValueError(
                f"a rollout batch of {self.global_batch_size} prompts over {self.world_size} processes: "
                "per_device_train_batch_size and gradient_accumulation_steps must be >= 1"
            )
        self.batches_per_pass = self.num_rows // self.global_batch_size
        if self.batches_per_pass == 0:
            raise ValueError(
                f"train_dataset has {self.num_rows} prompts, fewer than one rollout batch "
                f"({self.global_batch_size} = per_device_train_batch_size * gradient_accumulation_steps * "
                "processes): add prompts or lower the batch size."
            )
        self._perm_pass, self._perm = -1, None

    def indices(self, batch_index: int) -> list[int]:
        """Dataset rows of this rank for rollout batch ``batch_index`` (0-based)."""
        pass_index, offset = divmod(batch_index, self.batches_per_pass)
        if pass_index != self._perm_pass:
            gen = torch.Generator().manual_seed(self.seed + pass_index)
            self._perm, self._perm_pass = torch.randperm(self.num_rows, generator=gen).tolist(), pass_index
        start = offset * self.global_batch_size
        local = self.global_batch_size // self.world_size
        start += self.rank * local
        return self._perm[start : start + local]


def left_pad(sequences: list[list[int]], pad_token_id: int) -> torch.Tensor:
    """Stack token lists into a [B, max_len] tensor, padding on the left."""
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    for i, seq in enumerate(sequences):
        if seq:
            out[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
    return out


def collate_prompts(rows: list[dict], pad_token_id: int) -> dict:
    """Left-padded ``input_ids`` [B, P] plus every other column as a list (for reward functions)."""
    batch = {"input_ids": left_pad([r["input_ids"] for r in rows], pad_token_id)}
    for key in rows[0]:
        if key != "input_ids":
            batch[key] = [r[key] for r in rows]
    return batch
