"""Running one Pass through the model and reading out option log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.attention import AttentionPlan, DocSpan, tree_mask
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

    @torch.inference_mode()
    def run(self, docs: list[FlatDoc]) -> list[DocScores]:
        """Run the documents as one packed pass."""
        cfg = self.model.cfg
        spans, start = [], 0
        for doc in docs:
            full = tree_mask(doc.node, doc.positions, doc.ancestors, None)
            local = (tree_mask(doc.node, doc.positions, doc.ancestors, cfg.sliding_window)
                     if doc.max_position >= cfg.sliding_window else full)
            spans.append(DocSpan(start, doc.length, full.to(self.device), local.to(self.device)))
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
