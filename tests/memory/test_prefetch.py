"""BatchPrefetcher: same batches in the same order, read ``window`` batches ahead."""

from __future__ import annotations

import pytest
import torch

from rapidfire_hf.memory import BatchPrefetcher


class CountingSource:
    """An iterable that records how many batches were taken from it."""

    def __init__(self, n):
        self.batches = [{"input_ids": torch.full((2, 3), i), "meta": [i, i], "step": i} for i in range(n)]
        self.taken = 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            self.taken += 1
            yield b


@pytest.mark.parametrize("window", [0, 1, 3, 10])
def test_same_batches_same_order_and_look_ahead(window):
    source = CountingSource(5)
    it = iter(BatchPrefetcher(source, window=window, device="cpu"))
    first = next(it)
    assert source.taken == min(5, window + 1)  # the current batch plus `window` prepared ones
    out = [first, *it]
    assert len(out) == 5 and len(BatchPrefetcher(source, window)) == 5
    for i, b in enumerate(out):
        assert torch.equal(b["input_ids"], torch.full((2, 3), i)) and b["meta"] == [i, i] and b["step"] == i


def test_negative_window_is_refused():
    with pytest.raises(ValueError, match="window=-1"):
        BatchPrefetcher([], window=-1)


@pytest.mark.gpu
def test_cuda_copies_arrive_intact_and_in_order():
    batches = [(torch.randn(64, 128), {"ids": torch.arange(64) + i}) for i in range(6)]
    out = list(BatchPrefetcher(batches, window=2, device="cuda"))
    for (x, d), (gx, gd) in zip(batches, out):
        assert gx.is_cuda and gd["ids"].is_cuda
        assert torch.equal(gx.cpu(), x) and torch.equal(gd["ids"].cpu(), d["ids"])
