"""Prompt data for PPO: validation, tokenization, a deterministic resumable batch order, left-padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def prepare_prompt_dataset(
    dataset, tokenizer, text_field: str = "prompt", max_prompt_length: int | None = None
):
    """Return ``dataset`` with an ``input_ids`` column (tokenizing ``text_field`` when needed).

    Raises:
        ValueError: the dataset has neither ``input_ids`` nor the text column, or is empty.
    """
    if dataset is None:
        raise ValueError(
            "PPOTrainer needs a train_dataset of prompts (a `prompt` text column or `input_ids`)."
        )
    columns = list(getattr(dataset, "column_names", None) or [])
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty: PPO needs at least one prompt per rollout batch.")
    if "input_ids" not in columns:
        if text_field not in columns:
            raise ValueError(
                f"train_dataset has no prompt column: expected a '{text_field}' text column or an 'input_ids' "
                f"column, found {columns}. Rename your prompt column to '{text_field}' or set "
                "PPOConfig(dataset_text_field=...)."
            )

        def tokenize(row):
            return {"input_ids": tokenizer(row[text_field], add_special_tokens=True)["input_ids"]}

        dataset = dataset.map(tokenize, desc="Tokenizing prompts")
    if max_prompt_length is not None:
        dataset = dataset.map(lambda row: {"input_ids": row["input_ids"][-max_prompt_length:]})
    return dataset


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
