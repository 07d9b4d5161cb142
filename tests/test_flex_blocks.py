"""The tree rule on CUDA (kernels/flex_tree.py), checked on the CPU: each readout sees exactly
its one-question prompt, a branch row's keys are its root's (FlexAttention) and its parent
chain (kernels/branch_paths.py), every visible (query, key) pair of the root rule lies in a
kept key block, full blocks are fully visible, few blocks are kept needlessly, a document
keeps the same blocks wherever it lands in the pass, and a branch row visits its root's
blocks in the same order whatever other questions share its document; a completion prompt's
rows see its own tokens, and its blocks visit its path's blocks alike alone or sharing them."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from spinf_worker.engine.completion import prompt_doc
from spinf_worker.engine.layout import Branch, DocTree, ImageRows
from spinf_worker.engine.merge import merge, root_key
from spinf_worker.engine.runner import doc_span, pass_rows
from spinf_worker.kernels.flex_tree import BLOCK, TreeTokens, root_blocks, root_mask, tree_mask

WINDOW = 96


def _trees(seed: int, n: int = 5) -> list[DocTree]:
    rng = random.Random(seed)
    # Few distinct tokens, so branches share prefixes (and options their first tokens).
    return [DocTree([2] + [7] * rng.randint(1, 400),
                    [Branch([rng.choice((9, 10)) for _ in range(rng.randint(0, 12))],
                            [[rng.choice((11, 12)) for _ in range(rng.randint(1, 3))]
                             for _ in range(rng.randint(1, 4))])
                     for _ in range(rng.randint(1, 30))]) for _ in range(n)]


def _docs(seed: int, n: int = 5) -> list:
    return [t.flatten(0) for t in _trees(seed, n)]


def _tokens(docs: list, pad_blocks: int = 2) -> TreeTokens:
    rows = sum(d.length for d in docs) + pad_blocks * BLOCK
    return TreeTokens.of_pass(torch.from_numpy(pass_rows(docs, rows, 0)))


def _visible(t: TreeTokens, window: int | None, rule=tree_mask) -> torch.Tensor:
    n = t.doc.shape[0]
    return create_mask(rule(t, window), None, None, n, n, device="cpu")[0, 0]


def test_pass_rows_place_each_document_and_pad_the_rest():
    docs = _docs(4, n=3)
    rows = sum(d.length for d in docs) + BLOCK
    ids, pos, doc, end, root_end, parent, group, view_row = torch.from_numpy(
        pass_rows(docs, rows, 5)).long()
    assert (group == -1).all()       # no media
    assert torch.equal(view_row, torch.arange(rows))    # no completion prompts
    start = 0
    for i, d in enumerate(docs):
        here = slice(start, start + d.length)
        assert torch.equal(ids[here], d.input_ids) and torch.equal(pos[here], d.positions)
        real = torch.arange(d.length) < d.tokens
        assert torch.equal(doc[here], torch.where(real, i, -1))
        row = torch.arange(start, start + d.length)
        # a real row's subtree stays in its document; a padding row's is itself
        assert torch.equal(end[here] <= start + d.tokens, real)
        assert (end[here] > row).all() and torch.equal(end[here][~real], row[~real] + 1)
        # a padding row's root is empty; root rows have no parent, branch rows one before them
        assert torch.equal(root_end[here], torch.where(real, start + d.root, row))
        branch = (row >= start + d.root) & real
        assert (parent[here][~branch] == -1).all()
        up = parent[here][branch]
        assert ((up == -1) | ((up >= start + d.root) & (up < row[branch]))).all()
        start += d.length
    assert (ids[start:] == 5).all() and (pos[start:] == 0).all() and (doc[start:] == -1).all()
    assert torch.equal(end[start:], torch.arange(start, rows) + 1)
    assert torch.equal(root_end[start:], torch.arange(start, rows))
    assert (parent[start:] == -1).all()


@pytest.mark.parametrize("seed", [0, 1])
def test_each_readout_sees_exactly_its_one_question_prompt(seed):
    trees = _trees(seed, n=3)
    docs = [t.flatten(0) for t in trees]
    t = _tokens(docs)
    seen = _visible(t, None)
    ids = torch.from_numpy(pass_rows(docs, t.doc.shape[0], 0))[0].long()
    start = 0
    for tree, d in zip(trees, docs, strict=True):
        readouts, blk = d.readout_rows.tolist(), d.block
        for summand in range(len(blk.term_option)):
            k, readout = blk.term_option[summand], blk.term_readout[summand]
            b = blk.option_branch[k]
            br = tree.branches[b]
            option = br.options[k - np.searchsorted(blk.option_branch, b)]
            # the summand's place in its option: 0 = first token (read after the template)
            nth = int((blk.term_option[:summand] == k).sum())
            prompt = tree.root + br.prefix + option[:nth]
            row = start + readouts[readout]
            keys = torch.nonzero(seen[row]).flatten()
            assert ids[keys].tolist() == prompt
            assert t.pos[keys].tolist() == list(range(len(prompt)))
            assert blk.term_token[summand] == option[nth]
        start += d.length


def test_branches_sharing_a_prefix_share_its_rows():
    shared = DocTree([2, 7, 7], [Branch([9, 10, 11], [[5]]), Branch([9, 10, 12], [[5]]),
                                 Branch([9, 10, 11], [[6, 7]])]).flatten(0)
    assert shared.tokens == 3 + 4 + 1        # 9 10 11 12, and the sub-branch token 6
    assert shared.readout_rows[0] == shared.readout_rows[2]


@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_paths_are_the_masks_branch_keys(seed):
    docs = _docs(seed, n=2)
    t = _tokens(docs, pad_blocks=0)
    seen = _visible(t, None)
    start = 0
    for d in docs:
        rows, ok = d.paths
        for j in range(d.tokens - d.root):
            q = start + d.root + j
            keys = torch.nonzero(seen[q, start + d.root:]).flatten() + d.root
            assert sorted(rows[j][ok[j]].tolist()) == keys.tolist()
        start += d.length


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_branch_row_sees_its_root_and_its_parent_chain(seed, window):
    """FlexAttention's root part and the path kernel's parent walk are together the tree rule
    (the path kernel drops the chain's keys outside the window itself)."""
    docs = _docs(seed, n=2)
    t = _tokens(docs, pad_blocks=0)
    tree, root = _visible(t, window), _visible(t, window, root_mask)
    assert not (root & ~tree).any()
    parent = t.parent.tolist()
    for q in torch.nonzero((torch.arange(len(parent)) >= t.root_end) & (t.doc >= 0)
                           ).flatten().tolist():
        chain, key = [], q
        while key >= 0:
            if window is None or t.pos[q] - t.pos[key] < window:
                chain.append(key)
            key = parent[key]
        keys = torch.nonzero(tree[q] & ~root[q]).flatten().tolist()
        assert keys == sorted(chain) and (torch.tensor(keys) >= t.root_end[q]).all()


def _dense_blocks(t: TreeTokens, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    n = t.doc.shape[0]
    blocks = _visible(t, window, root_mask).view(n // BLOCK, BLOCK, n // BLOCK, BLOCK)
    return blocks.any(3).any(1), blocks.all(3).all(1)


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_blocks_cover_every_visible_pair(seed, window):
    t = _tokens(_docs(seed))
    (kept, full), (exact, exact_full) = root_blocks(t, window), _dense_blocks(t, window)
    assert not (exact & ~kept).any()          # nothing visible is skipped
    assert kept.sum() <= 1.6 * exact.sum()    # and little is visited for nothing
    assert not (full & ~exact_full).any()     # no mask skipped where it would hide a key
    # full blocks only where every query is a root row, and most of those
    rows = torch.arange(t.doc.shape[0])
    root_only = ((t.doc >= 0) & (rows < t.root_end)).view(-1, BLOCK).all(1)
    assert not full[~root_only].any()
    assert full.sum() >= 0.5 * (exact_full & root_only[:, None]).sum()


def test_a_document_keeps_the_same_blocks_wherever_it_lands():
    docs = _docs(3)
    target = docs[2]
    nb = target.length // BLOCK

    def own(docs_in_pass: list) -> tuple[torch.Tensor, torch.Tensor]:
        at = next(i for i, d in enumerate(docs_in_pass) if d is target)
        start = sum(d.length for d in docs_in_pass[:at]) // BLOCK
        kept, full = root_blocks(_tokens(docs_in_pass), WINDOW)
        assert not kept[start:start + nb, :start].any()
        assert not kept[start:start + nb, start + nb:].any()
        mine = slice(start, start + nb)
        return kept[mine, mine], full[mine, mine]

    alone = own([target])
    for order in (docs, docs[::-1]):
        kept, full = own(order)
        assert torch.equal(kept, alone[0]) and torch.equal(full, alone[1])


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", range(4))
def test_a_branch_row_visits_its_roots_blocks_alike_whatever_else_is_asked(seed, window):
    """FlexAttention reduces a row over the key blocks its query block visits, partial ones
    first, then full ones; blocks where the row sees nothing leave its sums as they are. So a
    branch row's bits depend only on which of its visible blocks are visited in which order:
    the same list, all partial, whatever other branches share the document and its blocks."""
    rng = random.Random(seed)
    root = [2] + [7] * rng.randint(100, 500)
    target = Branch([9, 10, 10, 9], [[11], [12, 11]])

    def visits(others: list[Branch]) -> list[tuple[int, bool]]:
        at = rng.randint(0, len(others))
        doc = DocTree(root, others[:at] + [target] + others[at:]).flatten(0)
        t = _tokens([doc], pad_blocks=0)
        row = int(doc.readout_rows[at])     # the others' options are one token each
        keep, full = root_blocks(t, window)
        sees = _visible(t, window, root_mask)[row].view(-1, BLOCK).any(1)
        qb = row // BLOCK
        assert not full[qb].any()
        return [(b, bool(full[qb, b])) for b in torch.nonzero(keep[qb] & sees).flatten().tolist()]

    alone = visits([])
    for _ in range(3):
        others = [Branch([rng.choice((9, 10)) for _ in range(rng.randint(0, 30))],
                         [[rng.choice((11, 12))] for _ in range(rng.randint(1, 3))])
                  for _ in range(rng.randint(1, 40))]
        assert visits(others) == alone


# Media: one image's soft tokens (root rows) see each other both ways.

def _media_docs(seed: int, n: int = 4) -> list:
    """Documents whose roots hold images (and an audio, which stays causal) of several
    sizes, some longer than a block or the window, some crossing block boundaries."""
    rng = random.Random(seed)
    docs = []
    for tree in _trees(seed, n):
        media, at = [], 1 + rng.randint(0, 60)
        for kind in rng.sample(["image", "image", "audio", "image"], rng.randint(1, 4)):
            size = rng.choice((5, 16, 130, 256))
            media.append(ImageRows(at, at + size, None, kind=kind))
            at += size + rng.randint(0, 40)
        tree.root = [2] + [7] * (at - 1) + [8] * rng.randint(0, 30)
        flat = tree.flatten(0)
        flat.media = media
        docs.append(flat)
    return docs


def _media_rule(mode: str, sliding: bool):
    """flex_tree's root rule for a model whose images see each other both ways on ``mode``'s
    layers (``sliding``: a sliding-window layer)."""
    return lambda t, window: root_mask(t, window, mode == "all" or (mode == "sliding"
                                                                     and sliding))


def test_pass_rows_give_an_images_rows_its_first_row_and_audio_none():
    docs = _media_docs(0)
    t = _tokens(docs)
    start = 0
    for d in docs:
        want = torch.full((d.length,), -1)
        for m in d.media:
            if m.kind == "image":
                want[m.start:m.end] = start + m.start
        assert torch.equal(t.group[start:start + d.length].long(), want)
        start += d.length
    assert (t.group[start:] == -1).all()


@pytest.mark.parametrize("mode", ["all", "sliding"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_media_rule_is_the_cpu_attentions_root_masks(seed, mode):
    """Each document's root rows see, on CUDA, what the CPU attention's root masks let them
    see (engine/runner.doc_span: transformers' rule, tests/test_media_*.py): an image's rows
    both ways, the window cutting them on sliding layers, audio and text causal."""
    docs = _media_docs(seed)
    t = _tokens(docs)
    start = 0
    for d in docs:
        span = doc_span(d, start, WINDOW, torch.device("cpu"), mode)
        causal = torch.ones(d.root, d.root, dtype=torch.bool).tril()
        full_rule = span.root_mask if span.root_mask is not None else causal
        sliding_rule = span.root_window if span.root_window is not None else full_rule
        root = slice(start, start + d.root)
        for sliding, want in ((False, full_rule), (True, sliding_rule)):
            seen = _visible(t, WINDOW if sliding else None, _media_rule(mode, sliding))
            assert torch.equal(seen[root, root], want), (sliding, start)
        start += d.length


def _doc_with_media(seed: int, parts: list[tuple[str, int]]) -> object:
    """A document whose root holds ``parts`` ((kind, soft tokens) in order, some text
    between), and questions after it."""
    rng = random.Random(seed)
    tree = _trees(seed, 1)[0]
    media, at = [], 1 + rng.randint(0, 40)
    for kind, size in parts:
        media.append(ImageRows(at, at + size, None, kind=kind))
        at += size + rng.randint(1, 30)
    tree.root = [2] + [7] * (at - 1) + [8] * rng.randint(0, 30)
    flat = tree.flatten(0)
    flat.media = media
    return flat


@pytest.mark.skipif(shutil.which("g++") is None, reason="Inductor's CPU kernels need g++")
@pytest.mark.parametrize("mode", ["sliding", "all"])
def test_flex_attention_over_the_pass_plan_is_the_cpu_attention_with_audio(mode):
    """The CUDA pass plan's block masks (engine/pass_plan.cuda_pass_plan's, kernels/
    flex_tree.build_flex_plan) through FlexAttention compiled for the CPU, which visits only
    the listed blocks and skips the rule in full ones as the CUDA kernel does (eager
    FlexAttention applies the rule everywhere, blocks aside): every root row's output equals
    the CPU tree attention's (engine/runner.doc_span's masks, transformers' rule) for an
    audio alone, an image then an audio, and an audio between two images, one longer than
    a block, on full and sliding layers. Audio rows stay causal, image rows see their
    image both ways. (Branch rows' own paths are kernels/branch_paths.py's, CUDA only.)"""
    from torch.nn.attention.flex_attention import flex_attention

    from spinf_worker.kernels.attention import AttentionPlan, packed_tree_attention
    from spinf_worker.kernels.flex_tree import build_flex_plan

    docs = [_doc_with_media(1, [("audio", 40)]),
            _doc_with_media(2, [("image", 16), ("audio", 33)]),
            _doc_with_media(3, [("image", 130), ("audio", 9), ("image", 5)])]
    rows = sum(d.length for d in docs)
    inputs = torch.from_numpy(pass_rows(docs, -(-rows // BLOCK) * BLOCK, 0))
    n = inputs.shape[1]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, 4, 64, generator=gen)
    k, v = torch.randn(2, n, 2, 64, generator=gen).unbind(0)
    starts = [sum(d.length for d in docs[:i]) for i in range(len(docs))]
    cpu_plan = AttentionPlan([doc_span(d, s, WINDOW, torch.device("cpu"), mode)
                              for d, s in zip(docs, starts, strict=True)])
    plan = build_flex_plan(TreeTokens.of_pass(inputs), WINDOW, mode)
    root = torch.cat([torch.arange(s, s + d.root) for d, s in zip(docs, starts, strict=True)])
    compiled = torch.compile(flex_attention, dynamic=False)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    for sliding in (False, True):
        want = packed_tree_attention(q[:rows], k[:rows], v[:rows], cpu_plan, sliding=sliding,
                                     scale=0.125)
        got = compiled(qh, kh, vh, block_mask=plan.window if sliding else plan.full,
                       scale=0.125, enable_gqa=True)[0].transpose(0, 1)
        err = float((got[root] - want[root]).norm() / want[root].norm())
        assert err < 1e-5, (sliding, err)
    # the check can fail: an audio grouped as an image is (seeing itself both ways on the
    # sliding layers) gives its rows other outputs
    grouped = inputs.clone()
    for d, s in zip(docs, starts, strict=True):
        for m in d.media:
            if m.kind == "audio":
                grouped[6, s + m.start:s + m.end] = s + m.start
    wrong = build_flex_plan(TreeTokens.of_pass(grouped), WINDOW, mode)
    want = packed_tree_attention(q[:rows], k[:rows], v[:rows], cpu_plan, sliding=True,
                                 scale=0.125)
    got = compiled(qh, kh, vh, block_mask=wrong.window, scale=0.125,
                   enable_gqa=True)[0].transpose(0, 1)
    assert float((got[root] - want[root]).norm() / want[root].norm()) > 1e-2


def _prompt_pass(seed: int) -> tuple[list[list[int]], list, list]:
    """Prompts of a few items (a context of 40-400 tokens, options of 1-5) merged as a pass
    merges them, with a scoring document before them; per prompt its row of each token."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(3):
        ctx = [2] + [rng.choice((7, 8)) for _ in range(rng.randint(40, 400))]
        prompts += [ctx + [o] + [rng.choice((7, 8)) for _ in range(rng.randint(0, 4))]
                    for o in (11, 12, 13)]
    docs = [prompt_doc(p, 0, 2, 0) for p in prompts]
    merged = merge(docs, [root_key(d, WINDOW) for d in docs], 0)
    flats, rows, start = [_docs(seed, n=1)[0]], {}, 0
    start = flats[0].length
    for flat, parts in merged:
        for i, part in parts:
            readouts = part.readouts if part is not None else np.arange(len(prompts[i]))
            rows[i] = start + flat.readout_rows[readouts].numpy()
        flats.append(flat)
        start += flat.length
    return prompts, flats, [rows[i] for i in range(len(prompts))]


def _keys_seen(t: TreeTokens, root: torch.Tensor, row: int, window: int | None) -> list[int]:
    """The keys ``row`` attends to: its root keys (FlexAttention's rule) and, for a branch
    row, its own path up its parents (kernels/branch_paths.py), in position order."""
    keys = torch.nonzero(root[row]).flatten().tolist()
    if row >= int(t.root_end[row]):
        at = row
        while at >= 0:
            if window is None or int(t.pos[row] - t.pos[at]) < window:
                keys.append(at)
            at = int(t.parent[at])
    return sorted(keys, key=lambda k: int(t.pos[k]))


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_prompt_row_sees_exactly_its_prompt(seed, window):
    """In a pass of completion prompts sharing blocks and tail tokens, FlexAttention's rule
    and the tail rows' own paths give each row of each prompt its own prompt's tokens up to
    itself, at their positions."""
    prompts, flats, rows = _prompt_pass(seed)
    t = _tokens(flats)
    ids = torch.from_numpy(pass_rows(flats, t.doc.shape[0], 0))[0].long()
    tree, root = _visible(t, window), _visible(t, window, root_mask)
    real = torch.nonzero(t.doc >= 0).flatten()
    real = real[real >= flats[0].length]
    blocks = real[real < t.root_end[real]]
    # block rows: no branch part, nothing for the path kernel
    assert torch.equal(tree[blocks], root[blocks]) and (t.parent[blocks] == -1).all()
    tails = 0
    for prompt, at in zip(prompts, rows, strict=True):
        assert len({r // BLOCK for r in at}) < len(at) or len(at) == 1
        for j, row in enumerate(at.tolist()):
            keys = _keys_seen(t, root, row, window)
            lo = 0 if window is None else max(0, j - window + 1)
            assert ids[keys].tolist() == prompt[lo:j + 1]
            assert t.pos[keys].tolist() == list(range(lo, j + 1))
            tails += row >= int(t.root_end[row])
    # tails are shared: fewer tail rows in the pass than tail tokens in the prompts
    assert 0 < int((t.root_end[real] <= real).sum()) < tails


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kept_blocks_cover_every_pair_an_image_sees(seed, window):
    t = _tokens(_media_docs(seed) + _docs(seed, n=2))
    kept, full = root_blocks(t, window, media=True)
    n = t.doc.shape[0]
    blocks = _visible(t, window, _media_rule("all", True)).view(n // BLOCK, BLOCK,
                                                                n // BLOCK, BLOCK)
    exact, exact_full = blocks.any(3).any(1), blocks.all(3).all(1)
    assert not (exact & ~kept).any()
    assert kept.sum() <= 1.6 * exact.sum()
    assert not (full & ~exact_full).any()
    # a text-only pass keeps the text rule's blocks exactly
    text = _tokens(_docs(seed))
    assert all(torch.equal(a, b) for a, b in zip(root_blocks(text, window, media=True),
                                                 root_blocks(text, window), strict=True))


def test_a_document_with_images_keeps_the_same_blocks_wherever_it_lands():
    docs = _media_docs(5) + _docs(5, n=2)
    # one whose image's rows cross a block boundary
    target = next(d for d in docs if any(m.kind == "image" and m.start // BLOCK
                                         < (m.end - 1) // BLOCK for m in d.media))
    nb = target.length // BLOCK

    def own(docs_in_pass: list) -> tuple[torch.Tensor, torch.Tensor]:
        at = next(i for i, d in enumerate(docs_in_pass) if d is target)
        start = sum(d.length for d in docs_in_pass[:at]) // BLOCK
        kept, full = root_blocks(_tokens(docs_in_pass), WINDOW, media=True)
        assert not kept[start:start + nb, :start].any()
        assert not kept[start:start + nb, start + nb:].any()
        mine = slice(start, start + nb)
        return kept[mine, mine], full[mine, mine]

    alone = own([target])
    assert alone[0].triu(1).any()       # an image's first rows visit its later blocks
    for order in (docs, docs[::-1]):
        kept, full = own(order)
        assert torch.equal(kept, alone[0]) and torch.equal(full, alone[1])


@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_prompt_block_visits_its_path_alike_alone_or_shared(seed, window):
    """Each query block of a prompt's whole blocks visits exactly its path's key blocks that
    the window reaches, in position order, each partial or full alike whether the prompt is
    alone or shares its leading blocks with others: FlexAttention then reduces it the same
    way. A tail row's query block has no full blocks, and of the blocks it visits, those
    where the row sees a key are its anchor's path, in order, seen alike alone or shared
    (the others it visits it sees nothing of: an exact no-op in the online softmax)."""
    prompts, flats, rows = _prompt_pass(seed)
    t = _tokens(flats)
    keep, full = root_blocks(t, window)
    visible = _visible(t, window, root_mask)
    n = t.doc.shape[0]
    exact = visible.view(n // BLOCK, BLOCK, n // BLOCK, BLOCK).any(3).any(1)
    assert not (exact & ~keep).any()          # nothing visible is skipped

    def visits(t, keep, full, visible, at: np.ndarray, whole: int):
        path = [int(r) // BLOCK for r in at[:whole:BLOCK]]     # the prompt's blocks, in order
        depth = {b: d for d, b in enumerate(path)}
        out = []
        for qb in path:
            listed = torch.nonzero(keep[qb]).flatten().tolist()
            assert set(listed) <= set(path)
            out.append([(depth[k], bool(full[qb, k])) for k in listed])
        for row in at[whole:].tolist():
            qb = row // BLOCK
            assert not full[qb].any() and row >= int(t.root_end[row])
            seen = []
            for kb in torch.nonzero(keep[qb]).flatten().tolist():
                bits = visible[row, kb * BLOCK:(kb + 1) * BLOCK]
                if bits.any():
                    seen.append((depth[kb], bits.tolist()))
            out.append(seen)
        return out

    shared_rows = sum(f.length for f in flats[1:])
    assert shared_rows < sum(prompt_doc(p, 0, 2, 0).length for p in prompts)
    for prompt, at in zip(prompts, rows, strict=True):
        whole = len(prompt) - len(prompt) % BLOCK
        alone = prompt_doc(prompt, 0, 2, 0)
        a_t = _tokens([alone])
        a_keep, a_full = root_blocks(a_t, window)
        expected = visits(a_t, a_keep, a_full, _visible(a_t, window, root_mask),
                          np.asarray([*range(whole), *range(alone.root, alone.tokens)]), whole)
        if whole:
            last = whole // BLOCK - 1      # its last block: the blocks the window reaches
            assert [d for d, _ in expected[last]] == [
                d for d in range(last + 1)
                if window is None or last * BLOCK - (d * BLOCK + BLOCK - 1) < window]
        assert visits(t, keep, full, visible, at, whole) == expected
