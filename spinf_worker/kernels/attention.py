"""Attention over packed read-once trees.

A pass holds several documents, each starting at a 128-aligned offset and padded to a
multiple of 128. Token q attends to token k iff both are in the same document, k lies on q's
ancestor path (root, own branch, own option) and pos(k) <= pos(q); on sliding-window layers
also pos(q) - pos(k) < window. The CPU path runs one masked SDPA per document, so a
document's attention never sees the shape of the pass around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DocSpan:
    start: int              # row offset in the pass (multiple of 128)
    length: int             # padded length (multiple of 128)
    full_mask: torch.Tensor       # [length, length] bool, True = may attend
    window_mask: torch.Tensor     # the same with the sliding window applied


@dataclass
class AttentionPlan:
    docs: list[DocSpan]


def tree_mask(node: torch.Tensor, pos: torch.Tensor, ancestors: torch.Tensor,
              window: int | None) -> torch.Tensor:
    """Mask of one document. ``node[t]`` is the tree node of token t (-1 for padding),
    ``ancestors[a, b]`` says node b is node a or one of its ancestors."""
    real = node >= 0
    safe = node.clamp(min=0)
    allowed = ancestors[safe][:, safe] & real[:, None] & real[None, :]
    allowed &= pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= (pos[:, None] - pos[None, :]) < window
    # Padding rows attend to themselves only: finite, and never read by real tokens.
    allowed |= torch.diag(~real)
    return allowed


def packed_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                          *, sliding: bool, scale: float,
                          softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for doc in plan.docs:
        rows = slice(doc.start, doc.start + doc.length)
        mask = doc.window_mask if sliding else doc.full_mask
        qd = q[rows].transpose(0, 1)
        kd = k[rows].transpose(0, 1).repeat_interleave(groups, dim=0)
        vd = v[rows].transpose(0, 1).repeat_interleave(groups, dim=0)
        if softcap is None:
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
        else:
            scores = torch.tanh((qd @ kd.transpose(-1, -2)) * (scale / softcap)) * softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            od = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype) @ vd
        out[rows] = od.transpose(0, 1)
    return out
