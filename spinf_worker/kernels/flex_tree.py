"""Packed tree attention on CUDA: FlexAttention for the root part, a path kernel for the rest.

Every row attends to its document's root through FlexAttention: root rows causally, branch
rows (questions' tokens) to the whole root. The rule is a ``mask_mod`` over per-token tensors of
the pass; which 128-token key blocks each query block visits, and in which of them every query
sees every key (no ``mask_mod`` needed), comes from per-block summaries of the tree
(``root_blocks``: a few [blocks, blocks] comparisons, not the dense [rows, rows] mask), so a
document's key blocks are the same tiles, visited in the same order, wherever the 128-aligned
document lands in the pass. A branch row's own path (its question's tokens down to itself)
is attended by kernels/branch_paths.py and merged in through the log-sum-exps: in FlexAttention
a row's path keys would share key blocks with other branches, and its bits would depend on the
other questions asked. For the same reason a query block holding branch rows has no full
blocks: its rows visit their root's blocks in block order, whatever rows share the block.
One image's (one video frame's) soft tokens, root rows of one document, see each other both
ways where the model reads images so (``media``: every layer, the sliding-window layers only,
or none): the rule is then causal-or-window OR the same media group, and the key blocks of
an image's later rows are visited too. Passes are padded to a few fixed sizes so the
compiled kernels are reused.

Roots kept from earlier passes (engine/root_cache.py) are keys before the pass's own
(``KeptKeys``): each kept root at a 128-aligned offset of its own, so its branch rows visit
its key blocks, the same tiles in the same order, as they would the root's rows in the pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

BLOCK = 128
# Heads wider than 256 (Gemma 4's global layers: 512): FlexAttention's default tiles ask for
# more shared memory than an H100/H200 has, so smaller ones are named (fixed, whatever the
# pass: a document's reduction order stays the same wherever it lands).
WIDE_HEAD_OPTIONS = {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 8}


@dataclass
class TreeTokens:
    """Per-row tensors of a pass, on the device."""

    doc: torch.Tensor       # document index, -1 for padding rows
    end: torch.Tensor       # end of the row's subtree (pass rows): k is on q's path iff k <= q < end[k]
    pos: torch.Tensor
    root_end: torch.Tensor  # end of the row's root: rows at or past it are branch rows
    parent: torch.Tensor    # a branch row's parent on its own path; -1 past its first token
    group: torch.Tensor     # an image's soft tokens: the pass row of its first one; else -1
    # the row whose view of the root a row has: itself, but a completion prompt's tail row
    # sees its anchor block's (engine/prompt_blocks.py; -1: none)
    view_row: torch.Tensor

    @classmethod
    def of_pass(cls, inputs: torch.Tensor) -> TreeTokens:
        """From a pass's rows (engine/pass_plan.pass_rows): ids, positions, document, subtree
        end, root end, parent, media group, view row."""
        return cls(inputs[2], inputs[3], inputs[1], inputs[4], inputs[5], inputs[6], inputs[7])


KEPT_BUCKET = 4096   # the kept keys are padded to a multiple of this: few compiled shapes


@dataclass
class KeptKeys:
    """Roots kept from earlier passes, as keys laid out before the pass's own: root ``i``
    (``roots[i]``, an engine/root_cache.KeptRoot) at key ``offsets[i]`` (a multiple of
    BLOCK), the rest zeros up to ``rows``. Per key, on the device: its document (-1:
    padding), the pass rows that see it, ``lo <= row < end``, and its position."""

    roots: list
    offsets: list[int]
    rows: int
    doc: torch.Tensor
    lo: torch.Tensor
    end: torch.Tensor
    pos: torch.Tensor

    def keys(self, layer: int, k: torch.Tensor, v: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values: the kept roots', then the pass's ``k``, ``v``."""
        out = []
        for i, t in enumerate((k, v)):
            parts, at = [], 0
            for root, offset in zip(self.roots, self.offsets, strict=True):
                kept = root.layers[layer][i]
                parts += [t.new_zeros(offset - at, *t.shape[1:]), kept]
                at = offset + kept.shape[0]
            out.append(torch.cat([*parts, t.new_zeros(self.rows - at, *t.shape[1:]), t]))
        return out[0], out[1]


@dataclass
class FlexPlan:
    full: BlockMask
    window: BlockMask
    tokens: TreeTokens      # the branch rows' own paths (kernels/branch_paths.py)
    window_size: int
    kept: KeptKeys | None = None


MEDIA_RULES = ("none", "sliding", "all")   # where an image's tokens see each other both ways


def build_flex_plan(tokens: TreeTokens, window: int, media: str = "none",
                    kept: KeptKeys | None = None) -> FlexPlan:
    """``media``: the layers on which one image's soft tokens see each other both ways
    ("all": Gemma 3; "sliding": the sliding-window layers, Gemma 4 with bidirectional
    vision; "none": causal everywhere, a text model's masks exactly). ``kept``: roots kept
    from earlier passes, keys before the pass's own."""
    if media not in MEDIA_RULES:
        raise ValueError(f"media rule {media!r} is not one of {MEDIA_RULES}")
    full_media, window_media = media == "all", media != "none"
    return FlexPlan(
        _block_mask(tokens, root_mask(tokens, None, full_media, kept), None, full_media, kept),
        _block_mask(tokens, root_mask(tokens, window, window_media, kept), window,
                    window_media, kept), tokens, window, kept)


def tree_mask(tokens: TreeTokens, window: int | None, media: bool = False,
              kept: KeptKeys | None = None):
    """The ``mask_mod`` of the tree rule (and the window, if any) over the pass's rows;
    ``media``: the rows of one media group see each other both ways. With ``kept`` keys the
    keys are those first, then the pass's rows: key ``kept.rows + r`` is row ``r``, and the
    pass rows that see a key are ``lo <= row < end`` (a pass row's: itself and its subtree; a
    kept root's: its document's rows in the pass)."""
    end, pos, group, lo = tokens.end, tokens.pos, tokens.group, None
    if kept is not None:
        rows = torch.arange(tokens.doc.shape[0], device=end.device, dtype=end.dtype)
        lo = torch.cat([kept.lo, rows])
        end, pos = torch.cat([kept.end, end]), torch.cat([kept.pos, pos])
        group = torch.cat([torch.full_like(kept.doc, -1), group])
    q_pos, q_group, view_row = tokens.pos, tokens.group, tokens.view_row

    def visible(b, h, q, k):
        # Rows follow the tree depth first, so q's ancestors are the rows k before it whose
        # subtree reaches it; a padding row's subtree is itself only. A prompt's tail row
        # sees what its anchor's last row sees.
        at = view_row[q]
        return ((k if lo is None else lo[k]) <= at) & (at < end[k])

    def visible_or_same_image(b, h, q, k):
        # an image's rows are root rows of one document: the rest of the rule holds for them
        return visible(b, h, q, k) | ((q_group[q] == group[k]) & (q_group[q] >= 0))

    rule = visible_or_same_image if media else visible

    def visible_in_window(b, h, q, k):
        return rule(b, h, q, k) & (q_pos[q] - pos[k] < window)

    return rule if window is None else visible_in_window


def root_mask(tokens: TreeTokens, window: int | None, media: bool = False,
              kept: KeptKeys | None = None):
    """The ``mask_mod`` of the tree rule restricted to root keys: what FlexAttention computes.
    (A kept root's keys come before every pass row, so they are all root keys.)"""
    tree, root_end = tree_mask(tokens, window, media, kept), tokens.root_end
    shift = 0 if kept is None else kept.rows

    def visible_in_root(b, h, q, k):
        return tree(b, h, q, k) & (k < root_end[q] + shift)

    return visible_in_root


def _block_mask(tokens: TreeTokens, mask_mod, window: int | None, media: bool,
                kept: KeptKeys | None = None) -> BlockMask:
    """Each query block visits its partial key blocks, then its full ones (no ``mask_mod``
    there), each list in block order."""
    n = tokens.doc.shape[0]
    keep, full = root_blocks(tokens, window, media)
    if kept is not None:
        kept_keep = kept_blocks(tokens, kept, window)
        keep = torch.cat([kept_keep, keep], dim=1)
        full = torch.cat([torch.zeros_like(kept_keep), full], dim=1)
    partial = keep & ~full

    def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = blocks.sum(1, dtype=torch.int32)
        order = torch.argsort((~blocks).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    keys = n + (0 if kept is None else kept.rows)
    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(n, keys),
                                    compute_q_blocks=False)


def kept_blocks(tokens: TreeTokens, kept: KeptKeys, window: int | None) -> torch.Tensor:
    """[query blocks, kept key blocks] bool: a kept root's blocks are visited by its
    document's query blocks (all branch rows), within the window; never full."""
    nb, mb = tokens.doc.shape[0] // BLOCK, kept.rows // BLOCK
    doc, pos = tokens.doc.view(nb, BLOCK), tokens.pos.view(nb, BLOCK)
    real = doc >= 0
    block_doc = doc.amax(1)
    kept_doc = kept.doc.view(mb, BLOCK).amax(1)
    keep = (block_doc[:, None] == kept_doc[None, :]) & (block_doc[:, None] >= 0)
    if window is not None:
        big = torch.iinfo(torch.int32).max
        pos_lo = torch.where(real, pos, big).amin(1)
        kept_real = kept.doc.view(mb, BLOCK) >= 0
        kept_pos_hi = torch.where(kept_real, kept.pos.view(mb, BLOCK), -1).amax(1)
        keep &= pos_lo[:, None] - kept_pos_hi[None, :] < window
    return keep


def root_blocks(tokens: TreeTokens, window: int | None, media: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two [blocks, blocks] bool tensors over (query block, key block) pairs of ``root_mask``:
    ``keep``, the pairs where some query may see some key (a superset of the exact rule that
    depends only on the document's own blocks), and ``full``, those where every query sees
    every key, only in query blocks of root rows alone. ``media``: rows of one media group
    see each other both ways, so a block holding an image's first rows keeps the blocks of
    its later rows (``full`` stays the causal rule's: a subset of what is fully visible)."""
    n = tokens.doc.shape[0]
    nb = n // BLOCK
    doc, end, pos, root_end, view_row = (t.view(nb, BLOCK) for t in (
        tokens.doc, tokens.end, tokens.pos, tokens.root_end, tokens.view_row))
    row = torch.arange(n, device=doc.device, dtype=end.dtype).view(nb, BLOCK)
    real = doc >= 0
    big = torch.iinfo(torch.int32).max

    def lo(t: torch.Tensor) -> torch.Tensor:
        return torch.where(real, t, big).amin(1)

    def hi(t: torch.Tensor) -> torch.Tensor:
        return torch.where(real, t, -1).amax(1)

    block_doc = doc.amax(1)                 # a document's rows never share a block with another's
    row_lo, row_hi = lo(row), hi(row)
    view_lo, view_hi = lo(view_row), hi(view_row)   # a query block's rows see as these do
    block_root_end = hi(root_end)           # one document per block: one root end
    q, k = (slice(None), None), (None, slice(None))
    keep = ((block_doc[q] == block_doc[k]) & (block_doc[q] >= 0)
            & (row_lo[k] <= view_hi[q]) & (hi(end)[k] > view_lo[q])
            & (row_lo[k] < block_root_end[q]))
    if media:
        # A group is a run of rows, its id its first row, so ids grow with the rows: two
        # blocks share a group iff their ranges of ids overlap (ids compared, never their
        # values, so a document keeps its blocks wherever it lands).
        group = tokens.group.view(nb, BLOCK)
        imaged = group >= 0
        g_lo = torch.where(imaged, group, big).amin(1)
        g_hi = torch.where(imaged, group, -1).amax(1)
        keep |= (g_lo[q] <= g_hi[k]) & (g_lo[k] <= g_hi[q])
    all_real = real.all(1)
    all_root = all_real & (row_hi < block_root_end)
    full = (keep & all_root[q] & all_root[k]
            & (row_hi[k] <= view_lo[q]) & (lo(end)[k] > view_hi[q]))
    if window is not None:
        pos_lo, pos_hi = lo(pos), hi(pos)
        keep &= pos_lo[q] - pos_hi[k] < window
        full &= pos_hi[q] - pos_lo[k] < window
    keep |= torch.eye(nb, dtype=torch.bool, device=keep.device) & (block_doc < 0)[q]
    return keep, full


@cache
def _compiled_flex():
    # One compiled kernel per (pass bucket, head layout): allow more than dynamo's default.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def flex_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlexPlan, *,
                        sliding: bool, scale: float, layer: int = 0) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]. ``layer``: which of the kept roots'
    keys and values the pass's kept documents see."""
    from .branch_paths import add_branch_paths

    k_all, v_all = (k, v) if plan.kept is None else plan.kept.keys(layer, k, v)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k_all, v_all))
    options = WIDE_HEAD_OPTIONS if q.shape[-1] > 256 else None
    out, aux = _compiled_flex()(qh, kh, vh, block_mask=plan.window if sliding else plan.full,
                                scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                kernel_options=options, return_aux=AuxRequest(lse=True))
    out = out[0].transpose(0, 1)
    add_branch_paths(q, k, v, out, aux.lse[0], plan.tokens,
                     plan.window_size if sliding else None, scale)
    return out
