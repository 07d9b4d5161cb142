"""Gated DeltaNet (linear attention with the gated delta rule) over packed read-once trees, in
plain torch (CPU and CUDA).

A DeltaNet layer reads its past through a recurrent state ``S`` ([heads, dk, dv]) and a short
causal convolution over its last ``kernel`` inputs, so a row depends on the rows of its
ancestor path in order, as attention does (kernels/attention.py):
- the root runs once per document: the chunked recurrence over its rows from a zero state
  (``root_scan``), which also gives the state after its last token;
- every branch row continues from that state along its own path (its branch ancestors and
  itself, the rows the attention gathers for it): the path's rows go through the same chunked
  recurrence from the root's state (``branch_scan``) and the row keeps the output at its own
  position. Each row thus forks the root's state and re-reads its own path: work per branch
  row ~ its path's padded width, no state per row unless the path is longer than a chunk;
- the convolution's window of a row is its previous ``kernel - 1`` rows on its path, the
  root's last rows before a branch's first token (``TreeScan.window``).
On CUDA the same rule runs token by token in two Triton launches a layer
(kernels/delta_triton.py) unless ``SPINF_DELTA_KERNEL=torch`` asks for this file's path.
Shapes depend only on the document (the root: its own length, in CHUNK-row chunks) and, for a
branch row, on its own path (TILE_ROWS rows at a time, grouped by the power-of-two width of
their paths as the attention groups them), so a document's bits never depend on what else
shares the pass, nor a question's on the other questions; reductions over a row (the l2 and
RMS norms) add in a fixed order (``rowsum``) so they never depend on the pass's row count.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..tiles import BRANCH_TILE
from .attention import AttentionPlan

CHUNK = 64   # rows of the chunked recurrence (transformers' and flash-linear-attention's)
# Branch rows per call: the attention's BRANCH_TILE on the CPU; on CUDA more at once, as a
# pass's tiles would cost more in kernel launches than in work (still one fixed shape).
TILE_ROWS = {"cpu": BRANCH_TILE, "cuda": 8 * BRANCH_TILE}
# the rule on CUDA: "triton" (kernels/delta_triton.py, where triton imports) or "torch" (this
# file's ops, as on the CPU: for comparison)
KERNEL = os.environ.get("SPINF_DELTA_KERNEL", "triton")
if KERNEL not in ("triton", "torch"):
    raise ValueError(f"SPINF_DELTA_KERNEL={KERNEL!r}: expected 'triton' or 'torch'")


def rowsum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by halving (zero-padded to a power of two): elementwise adds in
    one fixed order, whatever the tensor's other dims (a library reduction may split a row
    differently for another row count)."""
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, in fp32 (transformers' and fla's l2norm)."""
    x = x.float()
    return x * torch.rsqrt(rowsum(x * x) + eps)


@dataclass
class TreeScan:
    """What the DeltaNet layers of a pass need of its tree, built once per pass from the
    attention plan's documents (``of``): each row's convolution window."""

    window: torch.Tensor      # [rows, kernel] pass rows of each row's window, oldest first; -1: none

    @classmethod
    def of(cls, plan: AttentionPlan, rows: int, kernel: int, device) -> TreeScan:
        if plan.scan is None:
            plan.scan = cls(_windows(plan, rows, kernel, device))
        return plan.scan

    def conv(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The depthwise causal convolution along each row's path, fp32: x [rows, C],
        weight [C, kernel] -> [rows, C] (before the activation)."""
        xz = torch.cat((x.new_zeros(1, x.shape[1]), x)).float()
        w = weight.float()
        out = xz[self.window[:, 0] + 1] * w[:, 0]
        for j in range(1, w.shape[1]):
            out = out + xz[self.window[:, j] + 1] * w[:, j]
        return out


def _windows(plan: AttentionPlan, rows: int, kernel: int, device) -> torch.Tensor:
    window = torch.full((rows, kernel), -1, dtype=torch.long, device=device)
    back = torch.arange(kernel, device=device) - (kernel - 1)      # -(kernel-1) .. 0
    for doc in plan.docs:
        s, r = doc.start, doc.root
        root_rows = torch.arange(r, device=device)[:, None] + back
        window[s:s + r] = torch.where(root_rows >= 0, root_rows + s, -1)
        tail = torch.arange(r - kernel + 1, r, device=device)      # the root's last rows
        tail = torch.where(tail >= 0, tail + s, -1)
        for tiles in doc.branches:
            n = tiles.rows.shape[0]
            ext = torch.cat((tail.expand(n, -1), tiles.path + s), dim=1)
            last = tiles.path_ok.sum(1) - 1                          # the row's own place
            idx = last[:, None] + torch.arange(kernel, device=device)
            rows_of = ext.gather(1, idx)[:tiles.real]
            window[s + r + tiles.rows[:tiles.real]] = rows_of
    return window


def chunk_delta_rule(q, k, v, g, beta, state: torch.Tensor | None, chunk: int,
                     final_state: bool = True):
    """The gated delta rule over sequences of whole chunks, fp32. q, k: [B, H, T, dk] (both
    l2-normalised, q scaled by dk^-0.5); v: [B, H, T, dv]; g (log decay), beta: [B, H, T];
    state: [B or 1, H, dk, dv] or None (zeros). Rows past a sequence's end are zeros (g = 0,
    beta = 0): they change neither the outputs before them nor the state.
    -> out [B, H, T, dv], the state after the last row (None unless ``final_state``)."""
    b, h, t, dk = k.shape
    dv, n = v.shape[-1], t // chunk
    q, k, v = (x.reshape(b, h, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    k_beta = k * beta[..., None]
    decay = g.cumsum(-1)                                             # log decay from chunk start
    grow = decay.exp()[..., None]
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(
        _later(chunk, q.device), float("-inf")).exp()
    # the UT transform: (I + strictly lower part of beta k k^T * decay)^-1, applied by one
    # triangular solve to both right-hand sides
    system = (k_beta @ k.transpose(-1, -2)) * pair
    u, w = torch.linalg.solve_triangular(
        system, torch.cat((v * beta[..., None], k_beta * grow), dim=-1), upper=False,
        unitriangular=True).split([dv, dk], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * pair
    q_dec = q * grow
    updates = n if final_state else n - 1
    if updates:
        k_dec = (k * (decay[..., -1:] - decay).exp()[..., None]).transpose(-1, -2)
        step = decay[..., -1].exp()[..., None, None]
    if state is None:
        state = q.new_zeros(1, h, dk, dv)
    out = q.new_empty(b, h, n, chunk, dv)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = q_dec[:, :, i] @ state + attn[:, :, i] @ v_new
        if i < updates:
            state = state * step[:, :, i] + k_dec[:, :, i] @ v_new
    return out.reshape(b, h, t, dv), state if final_state else None


@functools.lru_cache(maxsize=16)
def _later(chunk: int, device: torch.device) -> torch.Tensor:
    """[chunk, chunk] bool: the pairs (i, j) with j after i."""
    return torch.ones(chunk, chunk, dtype=torch.bool, device=device).triu(1)


def root_scan(q, k, v, g, beta):
    """A document's root, [R, H, ...] rows: the chunked rule from a zero state, zero-padded to
    whole CHUNKs. -> out [R, H, dv], the state after the root [1, H, dk, dv]."""
    r = q.shape[0]
    pad = -r % CHUNK

    def seq(x: torch.Tensor) -> torch.Tensor:     # [R, H, ...] -> [1, H, R + pad, ...]
        x = x.movedim(0, 1)
        return F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))[None]

    out, state = chunk_delta_rule(seq(q), seq(k), seq(v), seq(g), seq(beta), None, CHUNK)
    return out[0, :, :r].movedim(0, 1), state


def branch_scan(q, k, v, g, beta, ok: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """A tile of branch rows, each with its own path gathered: q, k, v [B, W, H, ...], g, beta
    [B, W, H], ``ok`` [B, W] (the path's real entries, a prefix), from the root's ``state``.
    -> each row's output at its own place (the path's last real entry) [B, H, dv]."""
    width = q.shape[1]
    keep = ok[:, :, None]

    def seq(x: torch.Tensor) -> torch.Tensor:     # [B, W, H, ...] -> [B, H, W, ...], zeros past
        x = torch.where(keep[..., None] if x.dim() == 4 else keep, x, 0)
        return x.movedim(1, 2)

    out, _ = chunk_delta_rule(seq(q), seq(k), seq(v), seq(g), seq(beta), state,
                              min(width, CHUNK), final_state=False)
    last = (ok.sum(1) - 1)[:, None, None, None].expand(-1, out.shape[1], 1, out.shape[-1])
    return out.gather(2, last)[:, :, 0]


def tree_delta_rule(plan: AttentionPlan, q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule over a pass: q, k [rows, H, dk] (normalised, q scaled), v [rows,
    H, dv], g, beta [rows, H], fp32 -> [rows, H, dv] (padding rows: zeros)."""
    if q.device.type == "cuda" and KERNEL == "triton" and (rule := _triton_rule()) is not None:
        return rule(plan, q, k, v, g, beta)
    out = v.new_zeros(v.shape)
    size = TILE_ROWS.get(q.device.type, BRANCH_TILE)
    for doc in plan.docs:
        s, r = doc.start, doc.root
        root = slice(s, s + r)
        out[root], state = root_scan(q[root], k[root], v[root], g[root], beta[root])
        branch_out = out[s + r:s + doc.tokens]
        for tiles in doc.branches:
            for lo in range(0, tiles.rows.shape[0], size):
                path, ok = tiles.path[lo:lo + size], tiles.path_ok[lo:lo + size]
                if path.shape[0] < size:    # a whole tile: the bucket's first row again
                    path = torch.cat((path, path[:1].expand(size - path.shape[0], -1)))
                    ok = torch.cat((ok, ok[:1].expand(size - ok.shape[0], -1)))
                path = path + s
                o = branch_scan(q[path], k[path], v[path], g[path], beta[path], ok, state)
                real = min(size, tiles.real - lo)
                branch_out[tiles.rows[lo:lo + real]] = o[:real]
    return out


@functools.cache
def _triton_rule():
    """delta_triton.tree_delta_rule, or None where triton does not import."""
    try:
        from .delta_triton import tree_delta_rule as rule
    except ImportError:
        return None
    return rule
