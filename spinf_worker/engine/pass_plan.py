"""A pass on CUDA: its rows as one device array, and how it attends (the block masks of its
tree and the branch rows' own paths, built from those rows on the device).

Shared by the eager runner (engine/runner.py) and the captured graphs (engine/cuda_graphs.py),
so neither imports the other for it."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.attention import AttentionPlan
from .layout import FlatDoc

PASS_ROWS = 8    # the rows of pass_rows' array


def media_attention(model: torch.nn.Module) -> str:
    """The layers on which one image's soft tokens see each other both ways: "all" (Gemma 3
    multimodal), "sliding" (the sliding-window layers) or "none" (a text model, or Gemma 4
    without bidirectional vision: its masks are a text model's)."""
    if not getattr(model, "MEDIA", ()):
        return "none"
    return getattr(model, "media_attention", "all")


def cuda_pass_plan(model: torch.nn.Module, inputs: torch.Tensor,
                   real_rows: int | None = None, kept=None) -> AttentionPlan:
    """How a pass's [PASS_ROWS, rows] device rows (``pass_rows``) attend on CUDA.
    ``real_rows``: compute only those (None: every row, padding too). ``kept``: the kept
    roots its documents see (``kept_keys``)."""
    from ..kernels.flex_tree import TreeTokens, build_flex_plan

    flex = build_flex_plan(TreeTokens.of_pass(inputs), model.cfg.sliding_window,
                           media_attention(model), kept)
    return AttentionPlan([], flex=flex, rows=real_rows or inputs.shape[1])


def kept_keys(docs: list[FlatDoc], starts: list[int], device: torch.device):
    """The kept roots (engine/root_cache.py) of a pass's documents as keys before its own
    (kernels/flex_tree.KeptKeys), or None when no document has one."""
    from ..kernels.flex_tree import BLOCK, KEPT_BUCKET, KeptKeys

    kept = [(i, doc.kept_root) for i, doc in enumerate(docs) if doc.kept_root is not None]
    if not kept:
        return None
    offsets = np.cumsum([0, *(-(-root.rows // BLOCK) * BLOCK for _, root in kept)])
    rows = -(-int(offsets[-1]) // KEPT_BUCKET) * KEPT_BUCKET
    table = np.empty((4, rows), dtype=np.int32)
    # a padding key: no document, seen by no row
    table[0], table[1], table[2], table[3] = -1, np.iinfo(np.int32).max, -1, 0
    for (i, root), at in zip(kept, offsets, strict=False):
        keys = slice(int(at), int(at) + root.rows)
        table[0, keys], table[3, keys] = i, np.arange(root.rows)
        table[1, keys], table[2, keys] = starts[i], starts[i] + docs[i].tokens
    doc, lo, end, pos = torch.from_numpy(table).to(device).unbind(0)
    return KeptKeys([root for _, root in kept], [int(a) for a in offsets[:-1]], rows,
                    doc, lo, end, pos)


def pass_rows(docs: list[FlatDoc], rows: int, pad_id: int) -> np.ndarray:
    """A pass padded to ``rows``, as one int32 [PASS_ROWS, rows] array (one upload): token ids,
    positions, and the tree tensors of kernels/flex_tree.TreeTokens: the document (-1 for
    padding); the end of each row's subtree as a pass row (k is on q's path iff
    k <= q < end[k]); the end of the row's root (a branch row is one at or past it; a padding
    row's root is empty, it ends at the row itself); a branch row's parent on its own path
    (-1 at its first branch token, and for root and padding rows); and each row's media
    group: an image's (a video frame's) soft tokens hold the pass row of its first one, every
    other row -1 (audio stays causal); and the row whose view of the root each row has
    (itself; a completion prompt's tail row, its anchor block's last row, or -1)."""
    out = np.empty((PASS_ROWS, rows), dtype=np.int32)
    out[0], out[1], out[2], out[5], out[6] = pad_id, 0, -1, -1, -1
    # a padding row: its subtree is itself, and so is its path (its root is empty); every
    # row but a prompt's tail sees the root as itself
    out[3] = np.arange(1, rows + 1, dtype=np.int32)
    out[4] = out[7] = np.arange(rows, dtype=np.int32)
    start = 0
    for i, doc in enumerate(docs):
        end = start + doc.length
        out[0, start:end] = doc.input_ids.numpy()
        out[1, start:end] = doc.positions.numpy()
        out[2, start:start + doc.tokens] = i
        np.add(doc.span_end, start, out=out[3, start:end])
        out[4, start:start + doc.tokens] = start + doc.root
        if doc.prompts is not None:
            # a completion prompt's tail row sees the blocks its anchor's last row sees
            view = doc.prompts.block_view(doc.root)
            out[7, start:start + doc.tokens] = np.where(view >= 0, view + start, -1)
        # a branch row's parent as a pass row; -1 under the root (the block's first tokens)
        parents = out[5, start + doc.root:start + doc.tokens]
        np.add(doc.block.parent, start + doc.root, out=parents)
        parents[doc.block.root_children] = -1
        for image in doc.media:
            if image.kind == "image":
                out[6, start + image.start:start + image.end] = start + image.start
        start = end
    return out
