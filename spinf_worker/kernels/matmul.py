"""Batch-invariant matmul.

A library GEMM may pick a different kernel (and so a different reduction order) for a
different number of rows. Every call here hands the library the same shape: rows are cut
into fixed tiles and multiplied as a batch of identical ``[tile, K] @ [K, N]`` products, so a
row's bits never depend on how many other rows share the pass. Documents start at tile
boundaries, so a tile never mixes two documents either.
"""

from __future__ import annotations

import torch

ROW_TILE = 128      # body rows: the document alignment
READOUT_TILE = 32   # LM-head rows: each document's readouts are padded to this


def tiled_linear(x: torch.Tensor, weight: torch.Tensor, tile: int = ROW_TILE) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of shape ``[M, K]`` with ``M % tile == 0``."""
    rows, k = x.shape
    if rows % tile:
        raise ValueError(f"{rows} rows is not a multiple of the {tile}-row tile")
    n_tiles = rows // tile
    out = torch.bmm(x.view(n_tiles, tile, k), weight.t().unsqueeze(0).expand(n_tiles, -1, -1))
    return out.view(rows, -1)


def tiled_head(x: torch.Tensor, weight: torch.Tensor, tile: int = READOUT_TILE) -> torch.Tensor:
    """``x @ weight.T`` for a wide ``weight`` (the LM head): one ``[tile, K]`` product per tile.

    A batched product would copy the broadcast head once per tile; a loop of identical
    products reads it in place and keeps the fixed shape."""
    if x.shape[0] % tile:
        raise ValueError(f"{x.shape[0]} rows is not a multiple of the {tile}-row tile")
    return torch.cat([x[i:i + tile] @ weight.t() for i in range(0, x.shape[0], tile)])
