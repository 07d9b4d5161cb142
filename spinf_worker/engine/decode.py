"""Decoding extraction slots from the same read.

The pass keeps the keys and values of documents that have extraction slots. Each slot's
context is its document's root plus its own template branch; decoding steps then run every
beam of every slot of the pass together: one new row per beam, attending to its slot's kept
context and to the tokens it generated so far. The content is never read again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..tiles import ROW_TILE


@dataclass
class SlotJob:
    """One extraction slot of one combination, ready to decode."""

    context_rows: torch.Tensor       # rows into the kept keys/values (root + own branch)
    context_pos: torch.Tensor        # their positions
    first_logprobs: torch.Tensor     # [vocab] fp32: the distribution after the template prefix
    stops: tuple[str, ...] = ("\n",)  # texts that end the answer (not part of it)
    max_tokens: int = 32
    beam_width: int = 4
    candidates: int = 4
    allowed: Callable[[str], bool] = lambda text: True    # could ``text`` still grow into an answer
    complete: Callable[[str], bool] = lambda text: True   # is ``text`` a whole answer
    sample: tuple[float, int | None] | None = None        # (temperature, seed): generated slots


@dataclass
class Found:
    text: str
    logprob: float
    tokens: list[int] = field(default_factory=list)


@dataclass
class DecodePlan:
    """Attention for decoding steps (the model calls ``attend`` once per layer)."""

    ctx_k: dict[int, torch.Tensor]   # per layer [slots, L, Hkv, D]
    ctx_v: dict[int, torch.Tensor]
    ctx_pos: torch.Tensor            # [slots, L]
    ctx_ok: torch.Tensor             # [slots, L]
    window: int
    beam_slot: torch.Tensor = None   # [beams]
    q_pos: torch.Tensor = None       # [beams]: positions of this step's tokens
    gen_k: dict[int, torch.Tensor] = field(default_factory=dict)   # per layer [beams, t, Hkv, D]
    gen_v: dict[int, torch.Tensor] = field(default_factory=dict)
    gen_pos: torch.Tensor = None     # [beams, t]

    def attend(self, q, k, v, *, layer: int, sliding: bool, scale: float) -> torch.Tensor:
        n = self.beam_slot.shape[0]
        q, k, v = q[:n], k[:n], v[:n]
        gk = torch.cat((self.gen_k[layer], k[:, None]), 1) if layer in self.gen_k else k[:, None]
        gv = torch.cat((self.gen_v[layer], v[:, None]), 1) if layer in self.gen_v else v[:, None]
        self.gen_k[layer], self.gen_v[layer] = gk, gv
        keys = torch.cat((self.ctx_k[layer][self.beam_slot], gk), 1)
        values = torch.cat((self.ctx_v[layer][self.beam_slot], gv), 1)
        pos = torch.cat((self.ctx_pos[self.beam_slot], self.gen_pos, self.q_pos[:, None]), 1)
        ok = torch.cat((self.ctx_ok[self.beam_slot],
                        torch.ones(n, gk.shape[1], dtype=torch.bool, device=q.device)), 1)
        if sliding:
            ok &= (self.q_pos[:, None] - pos) < self.window
        hkv = keys.shape[2]
        qg = q.view(n, hkv, -1, q.shape[-1])
        s = torch.einsum("nkgd,nlkd->nkgl", qg, keys) * scale
        s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
        o = torch.einsum("nkgl,nlkd->nkgd", torch.softmax(s, -1), values).reshape(q.shape)
        out = q.new_zeros(-(-n // ROW_TILE) * ROW_TILE, *q.shape[1:])
        out[:n] = o
        return out

    def advance(self, parents: torch.Tensor) -> None:
        """Keep the beams ``parents`` (indices into this step's beams), in that order."""
        self.gen_pos = torch.cat((self.gen_pos, self.q_pos[:, None]), 1)[parents]
        self.gen_k = {layer: t[parents] for layer, t in self.gen_k.items()}
        self.gen_v = {layer: t[parents] for layer, t in self.gen_v.items()}
        self.beam_slot = self.beam_slot[parents]
        self.q_pos = self.q_pos[parents] + 1


@dataclass
class _Beam:
    slot: int
    tokens: list[int]
    logprob: float
    text: str


class SlotDecoder:
    def __init__(self, model, tokenizer, eos_id: int, pad_id: int):
        self.model, self.tokenizer, self.eos_id, self.pad_id = model, tokenizer, eos_id, pad_id

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _extend(self, job: SlotJob, beam: _Beam, token: int, logprob: float,
                found: list[Found], out: list[_Beam]) -> None:
        """Beam + token: a finished answer, a live beam, or nothing (off the grammar)."""
        tokens = [*beam.tokens, token]
        total = beam.logprob + logprob
        if token == self.eos_id:
            if job.complete(beam.text):
                found.append(Found(beam.text, total, tokens))
            return
        text = self._text(tokens)
        ends = [i for i in (text.find(e, max(len(beam.text) - len(e) + 1, 0)) for e in job.stops)
                if i >= 0]
        if ends:
            cut = min(ends)
            if job.complete(text[:cut]):
                found.append(Found(text[:cut], total, tokens))
            return
        if job.allowed(text):
            out.append(_Beam(beam.slot, tokens, total, text))

    def _expand(self, job: SlotJob, beam: _Beam, logprobs: torch.Tensor, found: list[Found],
                gen: torch.Generator | None) -> list[_Beam]:
        out: list[_Beam] = []
        if job.sample is not None:
            temperature, _ = job.sample
            if temperature > 0:
                token = int(torch.multinomial(torch.softmax(logprobs / temperature, -1), 1,
                                              generator=gen))
            else:
                token = int(torch.argmax(logprobs))
            self._extend(job, beam, token, float(logprobs[token]), found, out)
            return out
        # Search the most likely continuations first; constrained slots may need to look
        # further down the list for tokens their grammar allows.
        k = job.beam_width * 2
        while True:
            top = torch.topk(logprobs, min(k, logprobs.shape[0]))
            out.clear()
            before = len(found)
            for lp, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                self._extend(job, beam, tok, lp, found, out)
            if out or len(found) > before or k >= 4096:
                return out[: job.beam_width]
            del found[before:]
            k *= 8

    @torch.inference_mode()
    def decode(self, jobs: list[SlotJob], kept: dict[int, tuple[torch.Tensor, torch.Tensor]]
               ) -> list[list[Found]]:
        """Every slot's answers, most likely first."""
        width = max(int(j.context_rows.shape[0]) for j in jobs)
        rows = torch.zeros(len(jobs), width, dtype=torch.long)
        ok = torch.zeros(len(jobs), width, dtype=torch.bool)
        pos = torch.zeros(len(jobs), width, dtype=torch.long)
        for i, j in enumerate(jobs):
            n = j.context_rows.shape[0]
            rows[i, :n], ok[i, :n], pos[i, :n] = j.context_rows, True, j.context_pos
        dev = next(self.model.parameters()).device
        rows, ok, pos = rows.to(dev), ok.to(dev), pos.to(dev)
        plan = DecodePlan({layer: k[rows] for layer, (k, _) in kept.items()},
                          {layer: v[rows] for layer, (_, v) in kept.items()},
                          pos, ok, self.model.cfg.sliding_window)
        found: list[list[Found]] = [[] for _ in jobs]
        gens = [torch.Generator().manual_seed(j.sample[1]) if j.sample and j.sample[1] is not None
                else None for j in jobs]
        start = [_Beam(s, [], 0.0, "") for s in range(len(jobs))]
        beams = [b for s, job in enumerate(jobs)
                 for b in self._expand(job, start[s], job.first_logprobs, found[s], gens[s])]
        next_pos = [int(j.context_pos.max()) + 1 for j in jobs]
        plan.gen_pos = torch.zeros(len(beams), 0, dtype=torch.long, device=dev)
        plan.beam_slot = torch.tensor([b.slot for b in beams], dtype=torch.long, device=dev)
        plan.q_pos = torch.tensor([next_pos[b.slot] for b in beams], dtype=torch.long,
                                  device=dev)
        for _ in range(max(j.max_tokens for j in jobs) - 1):
            if not beams:
                break
            logprobs = self._step(beams, plan)
            survivors: list[tuple[int, _Beam]] = []
            for s, job in enumerate(jobs):
                mine = [i for i, b in enumerate(beams) if b.slot == s]
                if not mine:
                    continue
                if len(beams[mine[0]].tokens) >= job.max_tokens:   # cut short: keep as is
                    found[s].extend(Found(beams[i].text, beams[i].logprob, beams[i].tokens)
                                    for i in mine if job.complete(beams[i].text))
                    continue
                grown = [(i, nb) for i in mine
                         for nb in self._expand(job, beams[i], logprobs[i], found[s], gens[s])]
                grown.sort(key=lambda t: -t[1].logprob)
                grown = grown[: job.beam_width]
                best_found = max((f.logprob for f in found[s]), default=-math.inf)
                if len(found[s]) >= job.candidates and grown and grown[0][1].logprob < best_found:
                    continue   # no live beam can beat the answers already found
                survivors.extend(grown)
            beams = [b for _, b in survivors]
            plan.advance(torch.tensor([i for i, _ in survivors], dtype=torch.long, device=dev))
        for b in beams:   # still live after the last step: cut short at max_tokens
            if jobs[b.slot].complete(b.text):
                found[b.slot].append(Found(b.text, b.logprob, b.tokens))
        for s, job in enumerate(jobs):
            found[s].sort(key=lambda f: -f.logprob)
            del found[s][job.candidates:]
        return found

    def _step(self, beams: list[_Beam], plan: DecodePlan) -> torch.Tensor:
        """Feed each beam's last token; full-vocabulary logprobs of its next token."""
        n = len(beams)
        padded = -(-n // ROW_TILE) * ROW_TILE
        dev = plan.q_pos.device
        ids = torch.full((padded,), self.pad_id, dtype=torch.long, device=dev)
        ids[:n] = torch.tensor([b.tokens[-1] for b in beams], device=dev)
        pos = torch.zeros(padded, dtype=torch.long, device=dev)
        pos[:n] = plan.q_pos
        hidden = self.model(ids, pos, plan)
        readout = -(-n // 32) * 32
        return self.model.readout_logprobs(hidden[:readout])[:n]
