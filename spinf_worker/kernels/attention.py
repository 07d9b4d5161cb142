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
document's bits never depend on what else shares the pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DocSpan:
    start: int                   # row offset in the pass (multiple of 128)
    root: int                    # rows [0, root) are the root
    tokens: int                  # rows [root, tokens) are branch tokens; the rest is padding
    path_rows: torch.Tensor      # [B, L] long: each branch token's own-path rows (doc-relative)
    path_ok: torch.Tensor        # [B, L] bool: valid path entries (causal)
    # Sliding-window variants; None when the document is shorter than the window.
    root_window: torch.Tensor | None = None       # [root, root] bool
    branch_root_window: torch.Tensor | None = None  # [B, root] bool
    path_window: torch.Tensor | None = None       # [B, L] bool


@dataclass
class AttentionPlan:
    """How a packed pass attends. Each layer calls ``attend``; ``keep_rows`` asks for the
    keys and values of those rows to be kept (``kept[layer] = (k, v)``), for decoding
    extraction slots from the same read afterwards."""

    docs: list[DocSpan]          # CPU: one span per document
    flex: object | None = None   # CUDA: a flex_tree.FlexPlan for the whole pass
    keep_rows: torch.Tensor | None = None
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    rows: int | None = None      # CUDA: the pass's real rows; the rest pads it to a bucket

    def attend(self, q, k, v, *, layer: int, sliding: bool, scale: float) -> torch.Tensor:
        if self.keep_rows is not None:
            if self.kept is None:
                self.kept = {}
            self.kept[layer] = (k[self.keep_rows], v[self.keep_rows])
        return packed_tree_attention(q, k, v, self, sliding=sliding, scale=scale)


def packed_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                          *, sliding: bool, scale: float) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]; padding rows come out as zeros."""
    if plan.flex is not None:
        from .flex_tree import flex_tree_attention

        return flex_tree_attention(q, k, v, plan.flex, sliding=sliding, scale=scale)
    out = torch.zeros_like(q)
    for doc in plan.docs:
        base = doc.start
        root = slice(base, base + doc.root)
        out[root] = _root_attention(q[root], k[root], v[root], doc, sliding, scale)
        if doc.tokens > doc.root:
            branch = slice(base + doc.root, base + doc.tokens)
            out[branch] = _branch_attention(q[branch], k[root], v[root],
                                            k[base + doc.path_rows], v[base + doc.path_rows],
                                            doc, sliding, scale)
    return out


def _root_attention(q, k, v, doc: DocSpan, sliding: bool, scale: float) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)
    kh = k.transpose(0, 1).repeat_interleave(groups, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(groups, dim=0)
    mask = doc.root_window if sliding else None
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=mask is None,
                                       scale=scale)
    return o.transpose(0, 1)


def _branch_attention(q, k_root, v_root, k_path, v_path, doc: DocSpan, sliding: bool,
                      scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; k/v_root: [R, Hkv, D]; k/v_path: [B, L, Hkv, D]."""
    b, hq, d = q.shape
    r, hkv = k_root.shape[0], k_root.shape[1]
    g = hq // hkv
    qg = q.view(b, hkv, g, d)
    # [Hkv, B*g, D] @ [Hkv, D, R] -> scores against the shared root, no key copies per head
    s_root = torch.bmm(qg.permute(1, 0, 2, 3).reshape(hkv, b * g, d),
                       k_root.permute(1, 2, 0)).view(hkv, b, g, r).permute(1, 0, 2, 3)
    s_path = torch.einsum("bkgd,blkd->bkgl", qg, k_path)
    s = torch.cat((s_root, s_path), dim=-1) * scale                  # [B, Hkv, g, R + L]
    path_ok = doc.path_window if sliding and doc.path_window is not None else doc.path_ok
    root_ok = (doc.branch_root_window if sliding and doc.branch_root_window is not None
               else path_ok.new_ones(b, r))
    keep = torch.cat((root_ok, path_ok), dim=-1)
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o_root = torch.bmm(p[..., :r].permute(1, 0, 2, 3).reshape(hkv, b * g, r),
                       v_root.permute(1, 0, 2)).view(hkv, b, g, d).permute(1, 0, 2, 3)
    o_path = torch.einsum("bkgl,blkd->bkgd", p[..., r:], v_path)
    return (o_root + o_path).reshape(b, hq, d)
