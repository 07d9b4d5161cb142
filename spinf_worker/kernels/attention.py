"""Attention over packed read-once trees.

Token q attends to token k iff both are in the same document, k lies on q's ancestor path
(root, own branch, own option) and pos(k) <= pos(q); on sliding-window layers also
pos(q) - pos(k) < window.

A document is a long root (the content) and many short branches, so attention is split the
way Hydragen / cascade attention split it, instead of one dense masked [n, n] product:
- root queries attend causally to root keys (one SDPA);
- branch queries attend to *all* root keys (every root position precedes every branch
  position) in one dense product, plus to their own short path of branch keys, gathered;
  both score sets go through a single softmax, so the result is exact.
Everything is computed per document with shapes that depend only on that document, so a
document's bits never depend on what else shares the pass; and branch rows go BRANCH_TILE
at a time, grouped by the width their own path pads to, so a question's bits never depend on
the other questions asked of its document either.

Completion prompts (engine/prompt_blocks.py) are blocks of PROMPT_BLOCK rows, then tails: each
block's queries attend to the keys of its path's blocks in position order (its own block
causally) in one product whose shape and mask depend only on the block's depth; a tail row
attends as a branch row does, with its anchor block's path for a root. So a row's bits are the
same whichever other prompts share its leading blocks and tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..tiles import BRANCH_TILE


@dataclass
class BranchTiles:
    """Branch rows whose own paths pad to one width (engine/layout.PathBucket), on the
    device; their attention runs BRANCH_TILE rows at a time."""

    rows: torch.Tensor           # [n] long: branch-token index (row - root); padded tiles
    real: int                    # rows[:real] are written back
    path: torch.Tensor           # [n, width] long: each row's own-path rows (doc-relative)
    path_ok: torch.Tensor        # [n, width] bool: real path entries
    # Sliding-window variants; None when the document is shorter than the window.
    root_window: torch.Tensor | None = None     # [n, root] bool
    path_window: torch.Tensor | None = None     # [n, width] bool


@dataclass
class PromptBlockRows:
    """One block of completion prompts: its queries, the keys of its path, what they see."""

    start: int                   # the block's first row in its document
    path: torch.Tensor           # [keys] long: its path's rows (doc-relative), its own last
    mask: torch.Tensor           # [PROMPT_BLOCK, keys] bool: causal
    window: torch.Tensor         # [PROMPT_BLOCK, keys] bool: causal and within the window


@cache
def prompt_block_mask(keys: int, block: int, window: int | None) -> torch.Tensor:
    """[block, keys] bool: the last block of a path of ``keys`` rows sees key j from query i
    iff j <= keys - block + i (and, with a window, keys - block + i - j < window)."""
    q = torch.arange(keys - block, keys)[:, None]
    k = torch.arange(keys)[None, :]
    seen = k <= q
    return seen if window is None else seen & (q - k < window)


@dataclass
class DocSpan:
    start: int                   # row offset in the pass (multiple of 128)
    root: int                    # rows [0, root) are the root
    tokens: int                  # rows [root, tokens) are branch tokens; the rest is padding
    branches: list[BranchTiles] = field(default_factory=list)
    # [root, root] bool: what root rows see on sliding-window layers (None: root_mask)
    root_window: torch.Tensor | None = None
    # [root, root] bool: what root rows see on the other layers (None: plain causal);
    # causal, or the rows of one image, which see each other both ways
    root_mask: torch.Tensor | None = None
    # completion prompts: their blocks (then the root's rows and masks are not read), and
    # their tails: per anchor block, its path's rows (doc-relative) and the tail rows' tiles
    blocks: list[PromptBlockRows] | None = None
    tails: list[tuple[torch.Tensor, list[BranchTiles]]] = field(default_factory=list)
    # a root read in an earlier pass (engine/root_cache.KeptRoot): the pass holds its branch
    # rows alone (root == 0), which see the kept keys and values as the root's
    kept: object | None = None


@dataclass
class AttentionPlan:
    """How a packed pass attends. Each layer calls ``attend``; ``keep_rows`` asks for the
    keys and values of those rows to be kept (``kept[layer] = (k, v)``), for decoding
    extraction slots from the same read afterwards."""

    decoding: ClassVar[bool] = False   # a pass's rows: its GEMMs take a pass's tiles
    docs: list[DocSpan]          # CPU: one span per document
    flex: object | None = None   # CUDA: a flex_tree.FlexPlan for the whole pass
    keep_rows: torch.Tensor | None = None
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    rows: int | None = None      # CUDA: the pass's real rows; the rest pads it to a bucket
    # media of the pass: (pass row of its first soft token, its pixels or audio features,
    # "image" or "audio"), read by the model
    media: list[tuple[int, object, str]] | None = None
    # the DeltaNet layers' view of the tree (kernels/delta_tree.TreeScan), built on first use
    scan: object | None = None
    # the same tree as kernels/delta_triton.TreeRows reads it on CUDA, built on first use
    delta_rows: object | None = None
    # roots to keep (engine/root_cache.py): their pass rows [start, end); per root, each
    # layer's (keys, values) of those rows
    keep_roots: list[tuple[int, int]] | None = None
    kept_roots: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] | None = None

    def attend(self, q, k, v, *, layer: int, sliding: bool, scale: float) -> torch.Tensor:
        if self.keep_rows is not None:
            if self.kept is None:
                self.kept = {}
            self.kept[layer] = (k[self.keep_rows], v[self.keep_rows])
        if self.keep_roots:
            if self.kept_roots is None:
                self.kept_roots = [{} for _ in self.keep_roots]
            for kept, (a, b) in zip(self.kept_roots, self.keep_roots, strict=True):
                kept[layer] = (k[a:b].clone(), v[a:b].clone())
        return packed_tree_attention(q, k, v, self, sliding=sliding, scale=scale, layer=layer)


def packed_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                          *, sliding: bool, scale: float, layer: int = 0) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]; padding rows come out as zeros.
    ``layer``: which of a kept root's keys and values its branch rows see."""
    if plan.flex is not None:
        from .flex_tree import flex_tree_attention

        return flex_tree_attention(q, k, v, plan.flex, sliding=sliding, scale=scale,
                                   layer=layer)
    out = torch.zeros_like(q)
    for doc in plan.docs:
        base = doc.start
        if doc.kept is not None:
            k_root, v_root = doc.kept.layers[layer]
            _attend_branch_tiles(q[base:base + doc.tokens], out[base:base + doc.tokens],
                                 k_root, v_root, k[base:base + doc.tokens],
                                 v[base:base + doc.tokens], doc.branches, sliding, scale)
            continue
        branch_q = q[base + doc.root:base + doc.tokens]
        branch_out = out[base + doc.root:base + doc.tokens]
        k_doc, v_doc = k[base:base + doc.tokens], v[base:base + doc.tokens]
        if doc.blocks is not None:
            for block in doc.blocks:
                rows = slice(base + block.start, base + block.start + block.mask.shape[0])
                path = block.path + base
                out[rows] = _prompt_block_attention(q[rows], k[path], v[path],
                                                    block.window if sliding else block.mask,
                                                    scale)
            for anchor_path, tiles in doc.tails:
                _attend_branch_tiles(branch_q, branch_out, k_doc[anchor_path],
                                     v_doc[anchor_path], k_doc, v_doc, tiles, sliding, scale)
            continue
        root = slice(base, base + doc.root)
        out[root] = _root_attention(q[root], k[root], v[root], doc, sliding, scale)
        _attend_branch_tiles(branch_q, branch_out, k[root], v[root], k_doc, v_doc,
                             doc.branches, sliding, scale)
    return out


def _attend_branch_tiles(branch_q, branch_out, k_root, v_root, k_doc, v_doc,
                         buckets: list[BranchTiles], sliding: bool, scale: float) -> None:
    """Branch rows that see one root (``k_root``, ``v_root``), BRANCH_TILE rows at a time,
    written into ``branch_out``; their paths index ``k_doc``, ``v_doc``."""
    for tiles in buckets:
        windowed = sliding and tiles.path_window is not None
        path_ok = tiles.path_window if windowed else tiles.path_ok
        for lo in range(0, tiles.rows.shape[0], BRANCH_TILE):
            tile = slice(lo, lo + BRANCH_TILE)
            rows, path = tiles.rows[tile], tiles.path[tile]
            o = _branch_attention(branch_q[rows], k_root, v_root, k_doc[path], v_doc[path],
                                  tiles.root_window[tile] if windowed else None,
                                  path_ok[tile], scale)
            real = min(BRANCH_TILE, tiles.real - lo)
            branch_out[rows[:real]] = o[:real]


def _root_attention(q, k, v, doc: DocSpan, sliding: bool, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    mask = doc.root_window if sliding and doc.root_window is not None else doc.root_mask
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                       scale=scale)
    return o.transpose(0, 1)


def _prompt_block_attention(q, k, v, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [PROMPT_BLOCK, Hq, D]; k/v: [path, Hkv, D], the block's path in position order."""
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


def _branch_attention(q, k_root, v_root, k_path, v_path, root_ok: torch.Tensor | None,
                      path_ok: torch.Tensor, scale: float) -> torch.Tensor:
    """One tile: q: [B, Hq, D]; k/v_root: [R, Hkv, D]; k/v_path: [B, L, Hkv, D]."""
    b, hq, d = q.shape
    r, hkv = k_root.shape[0], k_root.shape[1]
    g = hq // hkv
    qg = q.view(b, hkv, g, d)
    # [Hkv, B*g, D] @ [Hkv, D, R] -> scores against the shared root, no key copies per head
    s_root = torch.bmm(qg.permute(1, 0, 2, 3).reshape(hkv, b * g, d),
                       k_root.permute(1, 2, 0)).view(hkv, b, g, r).permute(1, 0, 2, 3)
    s_path = torch.einsum("bkgd,blkd->bkgl", qg, k_path)
    s = torch.cat((s_root, s_path), dim=-1) * scale                  # [B, Hkv, g, R + L]
    if root_ok is None:
        root_ok = path_ok.new_ones(b, r)
    keep = torch.cat((root_ok, path_ok), dim=-1)
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o_root = torch.bmm(p[..., :r].permute(1, 0, 2, 3).reshape(hkv, b * g, r),
                       v_root.permute(1, 0, 2)).view(hkv, b, g, d).permute(1, 0, 2, 3)
    o_path = torch.einsum("bkgl,blkd->bkgd", p[..., r:], v_path)
    return (o_root + o_path).reshape(b, hq, d)
