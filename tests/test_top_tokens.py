"""A row's top-k in the strict order (value, then the lower column), read through its chunks'
maxima: the same picks as ranking the whole row, whatever rows come with it."""

from __future__ import annotations

import math

import pytest
import torch

from spinf_worker.engine.top_tokens import CHUNK, strict_top


def ranked_whole(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: every column ranked, a stable sort keeping the lower column first among
    equal values."""
    order = torch.sort(-(x + 0.0), dim=1, stable=True).indices[:, :k]
    return x.gather(1, order), order


def test_small_rows_with_ties_and_infinities():
    x = torch.tensor([[-1.0, -0.5, -0.5, -math.inf, -2.0, -0.0],
                      [-math.inf, -math.inf, -3.0, -0.25, -0.25, -7.0]])
    values, picks = strict_top(x, 4)
    assert picks.tolist() == [[5, 1, 2, 0], [3, 4, 2, 5]]
    assert torch.equal(values, x.gather(1, picks))
    assert strict_top(x, 0)[1].shape == (2, 0)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_chunks_pick_what_the_whole_row_ranks(k):
    gen = torch.Generator().manual_seed(k)
    n = 64 * CHUNK + 37                   # a last chunk of 37 columns
    x = torch.randn(6, n, generator=gen).log_softmax(-1)
    x[1] = torch.round(x[1] * 2) / 2      # few distinct values: ties across many chunks
    x[2, -5:] = x[2].max() + 1            # the best values in the short last chunk
    x[3, ::CHUNK] = 0.0                   # the best value once in every chunk
    x[4, 7::CHUNK] = -0.0                 # ... as -0.0 in some, beside the 0.0s of row 3
    x[4, 3 * CHUNK + 9] = 0.0
    x[5] = -math.inf
    x[5, [11, 5 * CHUNK, n - 1]] = -1.0
    values, picks = strict_top(x, k)
    want_values, want_picks = ranked_whole(x, k)
    assert torch.equal(picks, want_picks)
    assert torch.equal(values.view(torch.int32), want_values.view(torch.int32))
    for rows in ([0], [4, 2], [5, 3, 1]):   # a row's picks are its own
        sub_values, sub_picks = strict_top(x[rows], k)
        assert torch.equal(sub_picks, picks[rows]) and torch.equal(sub_values, values[rows])


def test_distinct_values_as_topk_gives_them():
    x = torch.randn(32, 262_144, generator=torch.Generator().manual_seed(3)).log_softmax(-1)
    want = torch.topk(x, 6, dim=1)
    values, picks = strict_top(x, 6)
    assert torch.equal(values, want.values) and torch.equal(picks, want.indices)
