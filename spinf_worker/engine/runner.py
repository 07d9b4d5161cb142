"""Running one Pass through the model and reading out option log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.attention import AttentionPlan, DocSpan
from .layout import FlatDoc

READOUT_CHUNK = 256   # LM-head rows at a time (a multiple of READOUT_TILE)


@dataclass
class DocScores:
    """Per branch, per option: the summed logprob (fp32) and the full-vocab residual."""

    logprobs: list[torch.Tensor]    # [n_options] per branch
    residual: list[float]           # per branch: 1 - sum(exp(logprob))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 pad_id: int):
        self.model, self.device, self.dtype, self.pad_id = model, device, dtype, pad_id

    def span(self, doc: FlatDoc, start: int) -> DocSpan:
        """Attention metadata of one document placed at ``start``."""
        dev, window = self.device, self.model.cfg.sliding_window
        span = DocSpan(start, doc.root, doc.tokens, doc.path_rows.to(dev), doc.path_ok.to(dev))
        if doc.max_position >= window:
            root_pos = torch.arange(doc.root)
            branch_pos = doc.positions[doc.root:doc.tokens]
            path_pos = doc.positions[doc.path_rows]
            span.root_window = ((root_pos[:, None] >= root_pos[None, :])
                                & (root_pos[:, None] - root_pos[None, :] < window)).to(dev)
            span.branch_root_window = (branch_pos[:, None] - root_pos[None, :] < window).to(dev)
            span.path_window = (doc.path_ok & (branch_pos[:, None] - path_pos < window)).to(dev)
        return span

    @torch.inference_mode()
    def run(self, docs: list[FlatDoc]) -> list[DocScores]:
        """Run the documents as one packed pass."""
        spans, start = [], 0
        for doc in docs:
            spans.append(self.span(doc, start))
            start += doc.length
        ids = torch.cat([d.input_ids for d in docs]).to(self.device)
        pos = torch.cat([d.positions for d in docs]).to(self.device)
        hidden = self.model(ids, pos, AttentionPlan(spans))
        return [self._read(doc, hidden[span.start + doc.readout_rows.to(self.device)])
                for doc, span in zip(docs, spans)]

    def _read(self, doc: FlatDoc, rows: torch.Tensor) -> DocScores:
        # Gather every (readout, token) summand; the LM head runs in bounded row chunks.
        flat = [term for branch in doc.terms for opt in branch for term in opt]
        readout = torch.tensor([r for r, _ in flat], dtype=torch.long)
        token = torch.tensor([t for _, t in flat], dtype=torch.long)
        values = torch.empty(len(flat), dtype=torch.float32)
        for lo in range(0, rows.shape[0], READOUT_CHUNK):
            logprobs = self.model.readout_logprobs(rows[lo:lo + READOUT_CHUNK]).cpu()
            hit = (readout >= lo) & (readout < lo + READOUT_CHUNK)
            values[hit] = logprobs[readout[hit] - lo, token[hit]]
        out, i = DocScores([], []), 0
        for branch in doc.terms:
            sums = []
            for opt in branch:
                sums.append(values[i:i + len(opt)].sum())
                i += len(opt)
            lp = torch.stack(sums)
            out.logprobs.append(lp)
            out.residual.append(float(1.0 - lp.double().exp().sum()))
        return out
