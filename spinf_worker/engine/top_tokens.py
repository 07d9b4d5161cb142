"""Each row's k largest values in a strict order: the value, then the lower column.

A readout's top-N (echoed completions, decoding's beams) is over the whole vocabulary, and
``torch.topk`` on CUDA both costs several passes over it (a radix select: on lm-eval-shaped
completions it took a fifth of the 12B shape's device time) and picks among equal values by
how many rows it is given. Here a row is read once for the maxima of its CHUNK-column chunks;
the row's k best values lie in its k best chunks (ranked the same strict way: a chunk passed
over has k chunks ahead of it, each holding an element ahead of all of its own), so only
those k * CHUNK columns are ranked. Maxima are exact in any order of reduction, and ranks
break ties by position, so a row's picks are its own however many rows come with it.
"""

from __future__ import annotations

import torch

CHUNK = 1024


def strict_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, n] (float32) -> its rows' ``k`` largest values and their columns [rows, k],
    largest first, equal values by the lower column (-0.0 counts as 0.0)."""
    rows, n = x.shape
    if k == 0:
        return x[:, :0], torch.zeros(rows, 0, dtype=torch.int64, device=x.device)
    if n <= 2 * k * CHUNK:
        columns = torch.arange(n, device=x.device).expand(rows, n)
        return _ranked(x, columns, k)
    full = n // CHUNK
    maxima = x[:, :full * CHUNK].view(rows, full, CHUNK).amax(2)
    if n > full * CHUNK:
        maxima = torch.cat([maxima, x[:, full * CHUNK:].amax(1, keepdim=True)], dim=1)
    chunk_ids = torch.arange(maxima.shape[1], device=x.device).expand_as(maxima)
    _, chunks = _ranked(maxima, chunk_ids, k)
    columns = (chunks[:, :, None] * CHUNK
               + torch.arange(CHUNK, device=x.device)).view(rows, k * CHUNK)
    outside = columns >= n                       # the last chunk's columns past the row
    columns = columns.clamp(max=n - 1)
    return _ranked(x.gather(1, columns), columns, k, outside)


def _ranked(values: torch.Tensor, columns: torch.Tensor, k: int,
            outside: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best of ``values`` [rows, m] by (value, lower column), as (values, columns):
    one int64 key each, the value's bits ordered as the floats are above the column's
    complement, so topk has no ties to settle."""
    bits = (values + 0.0).contiguous().view(torch.int32)      # + 0.0: -0.0 becomes 0.0
    keys = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long().bitwise_left_shift_(32)
    keys += 0xFFFFFFFF - columns
    if outside is not None:
        keys.masked_fill_(outside, torch.iinfo(torch.int64).min)
    picks = torch.topk(keys, k, dim=1).indices
    return values.gather(1, picks), columns.gather(1, picks)
