"""Kept roots in the CUDA pass plan (kernels/flex_tree.KeptKeys, engine/pass_plan.kept_keys),
checked on the CPU: a document laid out as its branch rows on a kept root sees exactly the
keys it sees with its root in the pass (the same rule, pair for pair), its query blocks visit
its root's key blocks in the same order, and FlexAttention compiled for the CPU gives its
branch rows the same root part (its outputs; the CPU's kernel has no log-sum-exps) either way, beside documents whose
roots are in the pass, on full and sliding-window layers."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from spinf_worker.engine.pass_plan import kept_keys, pass_rows
from spinf_worker.engine.root_cache import KeptRoot
from spinf_worker.kernels.flex_tree import (
    BLOCK,
    TreeTokens,
    build_flex_plan,
    kept_blocks,
    root_blocks,
    root_mask,
)

from .test_flex_blocks import _docs

WINDOW = 96
HEADS, KV_HEADS, DIM = 4, 2, 32


def _layouts(seed: int):
    """Three documents with their roots in the pass, and the same pass with the middle one on
    its kept root: (docs, starts, rows) of each, and the middle document's full layout."""
    full = _docs(seed, n=3)
    middle = full[1]
    kept = KeptRoot({}, middle.root)
    on_kept = middle.block.place_on_kept(kept, 0)
    docs = [full[0], on_kept, full[2]]

    def placed(ds):
        starts = [sum(d.length for d in ds[:i]) for i in range(len(ds))]
        return ds, starts, -(-sum(d.length for d in ds) // BLOCK) * BLOCK + BLOCK

    return placed(full), placed(docs), middle, on_kept


def _vectors(doc, seed: int):
    """q, k, v of a document's rows in its full layout, the same whatever pass holds it."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(doc.length, HEADS, DIM, generator=gen),
            torch.randn(doc.length, KV_HEADS, DIM, generator=gen),
            torch.randn(doc.length, KV_HEADS, DIM, generator=gen))


def _pass_qkv(docs, starts, rows, full_docs, kept_index: int | None, seed: int):
    q = torch.zeros(rows, HEADS, DIM)
    k, v = torch.zeros(rows, KV_HEADS, DIM), torch.zeros(rows, KV_HEADS, DIM)
    for i, (d, s) in enumerate(zip(docs, starts, strict=True)):
        fq, fk, fv = _vectors(full_docs[i], seed + i)
        skip = full_docs[i].root if i == kept_index else 0   # its branch rows alone
        n = d.tokens
        q[s:s + n], k[s:s + n], v[s:s + n] = fq[skip:skip + n], fk[skip:skip + n], fv[skip:skip + n]
    return q, k, v


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("window", [None, WINDOW])
def test_a_kept_roots_branch_rows_see_the_same_keys(seed, window):
    (full, f_starts, f_rows), (docs, starts, rows), middle, on_kept = _layouts(seed)
    f_tokens = TreeTokens.of_pass(torch.from_numpy(pass_rows(full, f_rows, 0)))
    tokens = TreeTokens.of_pass(torch.from_numpy(pass_rows(docs, rows, 0)))
    kept = kept_keys(docs, starts, torch.device("cpu"))
    assert kept.rows % 4096 == 0 and kept.offsets == [0]
    f_seen = create_mask(root_mask(f_tokens, window), None, None, f_rows, f_rows,
                         device="cpu")[0, 0]
    seen = create_mask(root_mask(tokens, window, kept=kept), None, None, rows,
                       kept.rows + rows, device="cpu")[0, 0]
    # the middle document's branch rows: the same root keys, by their place in the root
    f_branch = slice(f_starts[1] + middle.root, f_starts[1] + middle.tokens)
    branch = slice(starts[1], starts[1] + on_kept.tokens)
    want = f_seen[f_branch, f_starts[1]:f_starts[1] + middle.root]
    assert want.any()
    assert torch.equal(seen[branch, :middle.root], want)
    assert not seen[branch, middle.root:].any()      # nothing else of the keys: paths aside
    # the others' rows see what they saw, and nothing of the kept root
    for i in (0, 2):
        f_rows_i = slice(f_starts[i], f_starts[i] + full[i].tokens)
        rows_i = slice(starts[i], starts[i] + docs[i].tokens)
        assert not seen[rows_i, :kept.rows].any()
        f_keys = f_seen[f_rows_i, f_starts[i]:f_starts[i] + full[i].tokens]
        keys = seen[rows_i, kept.rows + starts[i]:kept.rows + starts[i] + docs[i].tokens]
        assert torch.equal(keys, f_keys)
    # its query blocks visit its root's key blocks, in the same order
    keep, _ = root_blocks(f_tokens, window)
    f_visits = keep[f_branch.start // BLOCK:-(-f_branch.stop // BLOCK)]
    first = f_starts[1] // BLOCK
    root_blocks_n = -(-middle.root // BLOCK)
    visits = kept_blocks(tokens, kept, window)[branch.start // BLOCK:-(-branch.stop // BLOCK)]
    assert torch.equal(visits.any(0)[:root_blocks_n],
                       f_visits[:, first:first + root_blocks_n].any(0))
    assert not visits[:, root_blocks_n:].any()


@pytest.mark.parametrize("seed", [0, 3])
def test_flex_attention_gives_a_kept_roots_branch_rows_the_same_root_part(seed):
    (full, f_starts, f_rows), (docs, starts, rows), middle, on_kept = _layouts(seed)
    fq, fk, fv = _pass_qkv(full, f_starts, f_rows, full, None, seed)
    q, k, v = _pass_qkv(docs, starts, rows, full, 1, seed)
    # the kept root's keys and values: those its rows have in the full pass
    root = slice(f_starts[1], f_starts[1] + middle.root)
    layer = 0
    f_plan = build_flex_plan(TreeTokens.of_pass(torch.from_numpy(pass_rows(full, f_rows, 0))),
                             WINDOW)
    kept = kept_keys(docs, starts, torch.device("cpu"))
    kept.roots[0].layers[layer] = (fk[root].clone(), fv[root].clone())
    plan = build_flex_plan(TreeTokens.of_pass(torch.from_numpy(pass_rows(docs, rows, 0))),
                           WINDOW, kept=kept)
    # past dynamo's recompile limit (other tests compile FlexAttention for other shapes) a
    # call would run eagerly, which reduces otherwise: the engine raises the limit alike
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    compiled = torch.compile(flex_attention, dynamic=False)
    f_branch = slice(f_starts[1] + middle.root, f_starts[1] + middle.tokens)
    branch = slice(starts[1], starts[1] + on_kept.tokens)
    for sliding in (False, True):
        def run(q, k, v, mask):
            qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out = compiled(qh, kh, vh, block_mask=mask, scale=0.125, enable_gqa=True)
            return out[0].transpose(0, 1)

        want = run(fq, fk, fv, f_plan.window if sliding else f_plan.full)
        k_all, v_all = kept.keys(layer, k, v)
        got = run(q, k_all, v_all, plan.window if sliding else plan.full)
        assert torch.equal(got[branch], want[f_branch]), sliding
        for i in (0, 2):
            a = slice(f_starts[i], f_starts[i] + full[i].tokens)
            b = slice(starts[i], starts[i] + docs[i].tokens)
            assert torch.equal(got[b], want[a]), (sliding, i)
