"""The key blocks FlexAttention visits on CUDA (kernels/flex_tree.py), checked on the CPU:
every visible (query, key) pair lies in a kept block, few blocks are kept needlessly, and a
document keeps the same blocks wherever it lands in the pass."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from spinf_worker.engine.layout import Branch, DocTree
from spinf_worker.engine.runner import pass_rows
from spinf_worker.kernels.flex_tree import BLOCK, TreeTokens, tree_blocks

WINDOW = 96


def _docs(seed: int, n: int = 5) -> list:
    rng = random.Random(seed)
    return [DocTree([2] + [7] * rng.randint(1, 400),
                    [Branch([9] * rng.randint(0, 12),
                            [[11] * rng.randint(1, 3) for _ in range(rng.randint(1, 4))])
                     for _ in range(rng.randint(1, 30))]).flatten(0) for _ in range(n)]


def _tokens(docs: list, pad_blocks: int = 2) -> TreeTokens:
    rows = sum(d.length for d in docs) + pad_blocks * BLOCK
    return TreeTokens.of_pass(torch.from_numpy(pass_rows(docs, rows, 0)))


def test_pass_rows_number_the_tree_across_the_pass():
    docs = _docs(4, n=3)
    rows = sum(d.length for d in docs) + BLOCK
    ids, pos, doc, branch, option = torch.from_numpy(pass_rows(docs, rows, 5)).long()
    start = 0
    seen_branches: set[int] = set()
    for i, d in enumerate(docs):
        here = slice(start, start + d.length)
        assert torch.equal(ids[here], d.input_ids) and torch.equal(pos[here], d.positions)
        real = torch.arange(d.length) < d.tokens
        assert torch.equal(doc[here], torch.where(real, i, -1))
        assert torch.equal(branch[here] >= 0, d.branch_of >= 0)
        assert torch.equal(option[here] >= 0, d.option_of >= 0)
        # ids are the document's own, shifted past the earlier documents' ids
        mine = set(branch[here][branch[here] >= 0].tolist())
        assert len(mine) == d.n_branches and not mine & seen_branches
        seen_branches |= mine
        start += d.length
    assert (ids[start:] == 5).all() and (pos[start:] == 0).all() and (doc[start:] == -1).all()


def _dense_blocks(t: TreeTokens, window: int | None) -> torch.Tensor:
    def visible(b, h, q, k):
        on_path = (t.branch[k] < 0) | ((t.branch[k] == t.branch[q])
                                       & ((t.option[k] < 0) | (t.option[k] == t.option[q])))
        seen = (t.doc[q] == t.doc[k]) & (t.doc[q] >= 0) & on_path & (t.pos[k] <= t.pos[q])
        if window is not None:
            seen = seen & (t.pos[q] - t.pos[k] < window)
        return seen | ((t.doc[q] < 0) & (q == k))

    n = t.doc.shape[0]
    mask = create_mask(visible, None, None, n, n, device="cpu")[0, 0]
    return mask.view(n // BLOCK, BLOCK, n // BLOCK, BLOCK).any(3).any(1)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_blocks_cover_every_visible_pair(seed, window):
    t = _tokens(_docs(seed))
    kept, exact = tree_blocks(t, window), _dense_blocks(t, window)
    assert not (exact & ~kept).any()          # nothing visible is skipped
    assert kept.sum() <= 1.6 * exact.sum()    # and little is visited for nothing


def test_a_document_keeps_the_same_blocks_wherever_it_lands():
    docs = _docs(3)
    target = docs[2]
    nb = target.length // BLOCK

    def own(docs_in_pass: list) -> torch.Tensor:
        at = next(i for i, d in enumerate(docs_in_pass) if d is target)
        start = sum(d.length for d in docs_in_pass[:at]) // BLOCK
        kept = tree_blocks(_tokens(docs_in_pass), WINDOW)
        assert not kept[start:start + nb, :start].any()
        assert not kept[start:start + nb, start + nb:].any()
        return kept[start:start + nb, start:start + nb]

    alone = own([target])
    assert torch.equal(own(docs), alone)
    assert torch.equal(own(docs[::-1]), alone)
