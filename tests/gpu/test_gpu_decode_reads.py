"""A decoding step's reads on CUDA (skipped without CUDA): each beam's P(end) and its best
continuations are worked out for many beams at once, and a beam's bits must not depend on how
many beams are beside it (CUDA's reductions split a row by the number of rows)."""

from __future__ import annotations

import pytest
import torch

from spinf_worker.engine.decode import _logsumexp_rows
from spinf_worker.engine.top_tokens import strict_top

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("columns", [1, 7, 3000, 262_144])
def test_a_rows_reads_are_its_own_among_any_number_of_rows(columns):
    gen = torch.Generator().manual_seed(columns)
    x = torch.randn(600, columns, generator=gen).log_softmax(-1)
    x[:, 1::2] = x[:, 0:columns - 1:2]       # ties: column 2j + 1 is column 2j
    x = x.cuda()
    k = min(6, columns)
    ends, (values, picks) = _logsumexp_rows(x), strict_top(x, k)
    for rows in ([0], [5, 3], list(range(40)), list(range(599, 100, -3))):
        index = torch.tensor(rows, device="cuda")
        sub = x.index_select(0, index)
        assert torch.equal(_logsumexp_rows(sub), ends[index])
        sub_values, sub_picks = strict_top(sub, k)
        assert torch.equal(sub_picks, picks[index]) and torch.equal(sub_values, values[index])
    want = x.double().logsumexp(1)
    assert torch.allclose(ends, want, rtol=0, atol=1e-9)
    best = torch.topk(x, k, dim=1).values
    assert torch.equal(values, best)   # the same values; among ties, the lower column
