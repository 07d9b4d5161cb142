"""Several media read by one tower run: their rows laid out in one buffer.

Each medium's rows start at a row tile and are padded to whole tiles, so every linear layer
over the buffer hands the library the same ``[ROW_TILE, K]`` products a medium has alone
(kernels/matmul.py), and the row-wise steps (norms, activations) read each row alone. What
mixes rows (attention, convolutions, pooling) runs medium by medium on its real rows, in
the shapes the medium has alone. So a medium's features are bit-identical whatever else the
pass holds. A pass's media are read in groups of at most ``TOWER_ROWS`` rows (memory).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..tiles import padded_rows

TOWER_ROWS = 16384      # rows of one tower run (a group of media); any bound keeps the bits


@dataclass(frozen=True)
class MediaRows:
    """Where each medium's real rows sit in a tower run's buffer."""

    counts: tuple[int, ...]     # real rows per medium
    starts: tuple[int, ...]     # first row per medium (a multiple of ROW_TILE)
    rows: int                   # the buffer's rows

    @classmethod
    def of(cls, counts: Sequence[int]) -> MediaRows:
        starts, at = [], 0
        for n in counts:
            starts.append(at)
            at += padded_rows(n)
        return cls(tuple(counts), tuple(starts), at)

    def __len__(self) -> int:
        return len(self.counts)

    def spans(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each medium's real rows."""
        return ((s, s + n) for s, n in zip(self.starts, self.counts, strict=True))

    def pack(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[n_i, ...]`` per medium -> ``[rows, ...]``, zeros between."""
        out = parts[0].new_zeros(self.rows, *parts[0].shape[1:])
        for (s, e), part in zip(self.spans(), parts, strict=True):
            out[s:e] = part
        return out

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each medium's real rows of a ``[rows, ...]`` buffer."""
        return [x[s:e] for s, e in self.spans()]


def tile_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` padded with zero rows to whole row tiles (the batch-invariant matmul's shape)."""
    return MediaRows.of([x.shape[0]]).pack([x])


def groups(counts: Sequence[int], limit: int | None = None) -> list[list[int]]:
    """Indices of the media in tower runs of at most ``limit`` (TOWER_ROWS) padded rows, in
    order (a larger medium runs alone)."""
    limit = limit or TOWER_ROWS
    out, rows = [], 0
    for i, n in enumerate(counts):
        if not out or rows + padded_rows(n) > limit:
            out.append([])
            rows = 0
        out[-1].append(i)
        rows += padded_rows(n)
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One medium's attention over its own rows: ``[n, heads, hd]`` -> ``[n, heads * hd]``.
    Batched 4-D inputs, because torch's CPU SDPA takes its flash kernel only for them (3-D
    inputs fall back to the math path: the whole score matrix, several times slower)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], scale=scale)
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)
