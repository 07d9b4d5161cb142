"""Passes replayed as CUDA graphs.

A small model's pass is a few hundred short kernels: launching them one by one from Python
costs more host time than the device spends running them, and the host is also the one
laying out the next requests. Each pass-size bucket's whole forward (block masks from the
tree tensors, every layer, the final norm) is captured once and then replayed: the host
copies the pass's input rows (engine/pass_plan.pass_rows) into the graph's buffer, through
a pinned buffer of its ring (engine/host_staging.py), and launches one graph.

A replay computes every row of the bucket, padding too; the kernels are row-wise or
batch-invariant, so a row's bits are those of the eager forward over the real rows only.
Replays and the readouts that follow them are ordered on one stream, so the graphs can share
one memory pool and each bucket's output buffer is read before the next replay rewrites it.
"""

from __future__ import annotations

import numpy as np
import torch

from .host_staging import HostStaging
from .pass_plan import cuda_pass_plan, pass_rows


class PassGraph:
    """One bucket's captured forward: ``inputs`` [PASS_ROWS, rows] int32 in, ``hidden`` out."""

    def __init__(self, model: torch.nn.Module, rows: int, pool):
        device = next(model.parameters()).device
        # capture on a pass of padding rows only
        self.inputs = torch.from_numpy(pass_rows([], rows, 0)).to(device)

        def forward() -> torch.Tensor:
            plan = cuda_pass_plan(model, self.inputs)
            return model(self.inputs[0].long(), self.inputs[1].long(), plan)

        # Compile and autotune outside the capture (on a side stream, as capture needs).
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = forward()


class PassGraphs:
    """The captured graph of each pass bucket, captured the first time the bucket runs."""

    def __init__(self, model: torch.nn.Module, staging: HostStaging):
        self.model = model
        self.staging = staging
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[int, PassGraph] = {}

    def graph(self, rows: int) -> PassGraph:
        """The bucket's graph, captured now if it has not been yet."""
        graph = self.graphs.get(rows)
        if graph is None:
            graph = self.graphs[rows] = PassGraph(self.model, rows, self.pool)
        return graph

    @torch.inference_mode()
    def run(self, inputs: np.ndarray) -> torch.Tensor:
        """``inputs``: a pass's [PASS_ROWS, rows] int32 rows on the host. Returns the final-norm hidden
        states of every row (a buffer the next replay of this bucket overwrites)."""
        graph = self.graph(inputs.shape[1])
        # The copy is queued behind the work already on the stream (the previous replay may
        # still be reading this buffer) without the host waiting.
        self.staging.upload(inputs, out=graph.inputs)
        graph.graph.replay()
        return graph.hidden
