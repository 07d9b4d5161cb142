"""How a pass attends on CUDA: the block masks of its tree, built from the pass's device rows.

Shared by the eager runner (engine/runner.py) and the captured graphs (engine/cuda_graphs.py),
so neither imports the other for it."""

from __future__ import annotations

import torch

from ..kernels.attention import AttentionPlan


def cuda_pass_plan(model: torch.nn.Module, inputs: torch.Tensor,
                   real_rows: int | None = None) -> AttentionPlan:
    """How a pass's [4, rows] device rows (``pass_rows``) attend on CUDA: the block masks of
    its tree. ``real_rows``: compute only those (None: every row, padding too)."""
    from ..kernels.flex_tree import TreeTokens, build_flex_plan

    flex = build_flex_plan(TreeTokens.of_pass(inputs), model.cfg.sliding_window)
    return AttentionPlan([], flex=flex, rows=real_rows or inputs.shape[1])
