"""Decoding extraction slots from the same read.

The pass keeps the keys and values of documents that have extraction slots. Each slot's
context is its document's root plus its own template branch; decoding steps then run every
beam of every slot of the pass together: one new row per beam, attending to its slot's kept
context and to the tokens it generated so far. The content is never read again.

A searched slot keeps its ``beam_width`` most likely beams, and at every step each beam may
also end: the answer's probability is P(its tokens) x P(the answer ends there). A text answer
ends at a token that starts with a stop text or a newline, or at a special token (end of
text); a number or amount ends when the next token cannot continue the value, so P(end) is
1 - P(the tokens its grammar allows next). "Bud" and "Bud Light" are different answers, each
with the probability of exactly that text.

A generated slot writes ``n`` sequences instead, ending at the same places or at
``max_tokens``: greedily (the end competes with the tokens as one event), or sampled from the
``top_k`` most likely continuations and the end, inside the ``top_p`` nucleus, each sequence
from its own random stream (seed, sequence).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..extract_values import ValueGrammar
from ..tiles import ROW_TILE

SAMPLE_TOP_K = 40   # continuations a sampled token is drawn from when the request names none


@dataclass(frozen=True)
class Sampling:
    """How a generated slot writes: ``temperature`` 0 is greedy; above 0 each token is drawn
    from the ``top_k`` most likely continuations (``SAMPLE_TOP_K`` when None) and the end,
    kept to the smallest set holding ``top_p`` of their probability; ``n`` sequences."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int = 0
    n: int = 1


@dataclass
class SlotJob:
    """One extraction slot of one combination, ready to decode."""

    context_rows: torch.Tensor       # rows into the kept keys/values (root + own branch)
    context_pos: torch.Tensor        # their positions
    first_logprobs: torch.Tensor     # [vocab] fp32: the distribution after the template prefix
    stops: tuple[str, ...] = ("\n",)  # texts that end a text answer (not part of it)
    max_tokens: int = 32
    beam_width: int = 4              # live beams of a searched slot
    candidates: int = 4              # answers the search makes sure of (the top ones)
    grammar: ValueGrammar | None = None   # numbers and amounts: what an answer may be
    sample: Sampling | None = None         # a generated slot


@dataclass
class Found:
    """One answer: its text and log-probability (a searched one: with its end; a generated
    one: of its tokens), and why it finished: "stop" (it ended) or "length" (max_tokens)."""

    text: str
    logprob: float
    tokens: list[int] = field(default_factory=list)
    finish: str = "stop"
    sequence: int = 0                # a generated slot: which of its n sequences


@dataclass
class DecodePlan:
    """Attention for decoding steps (the model calls ``attend`` once per layer)."""

    kept: dict[int, tuple[torch.Tensor, torch.Tensor]]   # per layer: the pass's kept K, V
    ctx_rows: torch.Tensor           # [slots, L]: each slot's context, rows into ``kept``
    ctx_pos: torch.Tensor            # [slots, L]: their positions
    ctx_ok: torch.Tensor             # [slots, L]: real entries (a slot's first ctx_len)
    ctx_len: torch.Tensor            # [slots]
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
        kept_k, kept_v = self.kept[layer]
        out = q.new_zeros(-(-n // ROW_TILE) * ROW_TILE, *q.shape[1:])
        gen_pos = torch.cat((self.gen_pos, self.q_pos[:, None]), 1)
        if q.is_cuda:   # each beam from its own keys alone (kernels/decode_attention.py)
            from ..kernels.decode_attention import decode_attention

            decode_attention(q, kept_k, kept_v, gk, gv, self.ctx_rows, self.ctx_pos,
                             self.ctx_len, gen_pos, self.beam_slot, self.q_pos,
                             self.window if sliding else None, scale, out)
            return out
        rows = self.ctx_rows[self.beam_slot]
        keys = torch.cat((kept_k[rows], gk), 1)
        values = torch.cat((kept_v[rows], gv), 1)
        pos = torch.cat((self.ctx_pos[self.beam_slot], gen_pos), 1)
        ok = torch.cat((self.ctx_ok[self.beam_slot],
                        torch.ones(n, gk.shape[1], dtype=torch.bool, device=q.device)), 1)
        if sliding:
            ok &= (self.q_pos[:, None] - pos) < self.window
        hkv = keys.shape[2]
        qg = q.view(n, hkv, -1, q.shape[-1])
        s = torch.einsum("nkgd,nlkd->nkgl", qg, keys) * scale
        s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
        o = torch.einsum("nkgl,nlkd->nkgd", torch.softmax(s, -1), values).reshape(q.shape)
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
class _Read:
    """A searched beam's step, read back from the device: log P(the answer ends here) and
    its most likely continuations (logprob, token, the grammar's state after it)."""

    end: float
    top: list[tuple[float, int, int]]


@dataclass
class _Beam:
    slot: int
    tokens: list[int]
    logprob: float
    text: str
    state: int = 0                   # the grammar's state after ``text`` (numbers, amounts)
    sequence: int = 0                # a generated slot: which sequence this is
    stream: torch.Generator | None = None   # ... and its random stream


class _Vocabulary:
    """What decoding needs to know of every token, worked out once per tokenizer: its text
    on its own, which tokens can never be part of an answer, which end a text answer (per set
    of stops), and which continue a value from each state of a grammar."""

    def __init__(self, tokenizer, eos_id: int, size: int, device: torch.device):
        known = min(tokenizer.get_vocab_size(), size)
        self.pieces = tokenizer.decode_batch([[i] for i in range(known)],
                                             skip_special_tokens=False)
        self.pieces += [""] * (size - known)    # rows of the readout past the tokenizer's
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.special_ids = {i for i in special | {eos_id} if i < size}
        special = sorted(self.special_ids)
        self.device = device
        self.special = torch.zeros(size, dtype=torch.bool, device=device)
        self.special[special] = True
        # tokens that add no text (pieces past the tokenizer's): never a continuation
        self.empty = torch.tensor([p == "" for p in self.pieces], device=device) & ~self.special
        self._ends: dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._value_pieces: dict[ValueGrammar, dict[str, list[tuple[int, str]]]] = {}
        self._extensions: dict[tuple[ValueGrammar, int],
                               tuple[torch.Tensor, list[int], list[int]]] = {}

    def ends(self, stops: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks over the vocabulary: the tokens that end a text answer right here (a special
        token, or a piece starting with one of ``stops``), and the tokens that cannot
        continue it (those, and the empty pieces)."""
        if stops not in self._ends:
            starts = tuple(stop for stop in stops if stop)
            mask = torch.tensor([bool(starts) and p.startswith(starts) for p in self.pieces],
                                device=self.device) | self.special
            self._ends[stops] = mask, mask | self.empty, mask.nonzero()[:, 0]
        return self._ends[stops][:2]

    def end_ids(self, stops: tuple[str, ...]) -> torch.Tensor:
        """The tokens of ``ends``' first mask as indices, in order: ``lp[end_ids]`` holds what
        ``lp[mask]`` does without the host waiting for the device to count them."""
        self.ends(stops)
        return self._ends[stops][2]

    def extensions(self, grammar: ValueGrammar, state: int
                   ) -> tuple[torch.Tensor, list[int], list[int]]:
        """The tokens whose text continues a value from ``state`` (on the device and as a
        list) and the states they lead to. A DFA's state says all that matters of the text so
        far, so this is computed once per state and reused by every beam and every slot."""
        key = (grammar, state)
        if key not in self._extensions:
            if grammar not in self._value_pieces:   # by first character: few can follow
                alphabet, by_first = grammar.alphabet, {}
                for i, piece in enumerate(self.pieces):
                    if piece and set(piece) <= alphabet and i not in self.special_ids:
                        by_first.setdefault(piece[0], []).append((i, piece))
                self._value_pieces[grammar] = by_first
            ids, states = [], []
            for char in grammar.next_chars(state):
                for token, piece in self._value_pieces[grammar].get(char, ()):
                    following = grammar.feed(state, piece)
                    if following != ValueGrammar.DEAD:
                        ids.append(token)
                        states.append(following)
            self._extensions[key] = (torch.tensor(ids, dtype=torch.long, device=self.device),
                                     ids, states)
        return self._extensions[key]


def _log1mexp(logp: float) -> float:
    """log(1 - exp(logp)) for logp <= 0; -inf when it rounds to nothing."""
    if logp >= 0:
        return -math.inf
    return math.log(-math.expm1(logp)) if logp > -0.693 else math.log1p(-math.exp(logp))


def _stream(seed: int, sequence: int) -> torch.Generator:
    """Sequence j of a generated slot draws from its own stream: the same (seed, j) gives the
    same draws whatever the other sequences do."""
    return torch.Generator().manual_seed(seed * 65_536 + sequence)


def _first_stop(text: str, since: int, stops: tuple[str, ...]) -> int | None:
    """Where the first stop (or newline) appears in ``text`` at or after ``since`` minus the
    stop's own length (a stop may straddle the last two tokens); None when none does."""
    hits = [i for i in (text.find(stop, max(since - len(stop) + 1, 0)) for stop in stops
                        if stop) if i >= 0]
    return min(hits) if hits else None


class SlotDecoder:
    def __init__(self, model, tokenizer, eos_id: int, pad_id: int):
        self.model, self.tokenizer, self.eos_id, self.pad_id = model, tokenizer, eos_id, pad_id
        self._vocabulary: _Vocabulary | None = None

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    def _vocab(self, size: int, device: torch.device) -> _Vocabulary:
        if self._vocabulary is None or len(self._vocabulary.pieces) != size:
            self._vocabulary = _Vocabulary(self.tokenizer, self.eos_id, size, device)
        return self._vocabulary

    @torch.inference_mode()
    def decode(self, jobs: list[SlotJob], kept: dict[int, tuple[torch.Tensor, torch.Tensor]]
               ) -> list[list[Found]]:
        """Every slot's answers: a searched slot's most likely first, a generated slot's in
        sequence order."""
        width = max(int(j.context_rows.shape[0]) for j in jobs)
        rows = torch.zeros(len(jobs), width, dtype=torch.long)
        ok = torch.zeros(len(jobs), width, dtype=torch.bool)
        pos = torch.zeros(len(jobs), width, dtype=torch.long)
        for i, j in enumerate(jobs):
            n = j.context_rows.shape[0]
            rows[i, :n], ok[i, :n], pos[i, :n] = j.context_rows, True, j.context_pos
        dev = next(self.model.parameters()).device
        rows, ok, pos = rows.to(dev), ok.to(dev), pos.to(dev)
        lengths = torch.tensor([j.context_rows.shape[0] for j in jobs], device=dev)
        plan = DecodePlan(kept, rows, pos, ok, lengths, self.model.cfg.sliding_window)
        vocab = self._vocab(int(jobs[0].first_logprobs.shape[-1]), dev)
        found: list[list[Found]] = [[] for _ in jobs]
        starts = [b for s, job in enumerate(jobs) for b in self._starts(s, job)]
        firsts = [job.first_logprobs.to(dev) for job in jobs]
        # the first step reads the pass's own logprobs
        beams = [b for _, b in self._next(jobs, starts, [firsts[b.slot] for b in starts],
                                          found, vocab)]
        next_pos = [int(j.context_pos.max()) + 1 for j in jobs]
        plan.gen_pos = torch.zeros(len(beams), 0, dtype=torch.long, device=dev)
        plan.beam_slot = torch.tensor([b.slot for b in beams], dtype=torch.long, device=dev)
        plan.q_pos = torch.tensor([next_pos[b.slot] for b in beams], dtype=torch.long,
                                  device=dev)
        while beams:
            logprobs = self._step(beams, plan)
            survivors = self._next(jobs, beams, list(logprobs), found, vocab)
            beams = [b for _, b in survivors]
            if beams:
                plan.advance(torch.tensor([i for i, _ in survivors], dtype=torch.long,
                                          device=dev))
        for answers, job in zip(found, jobs, strict=True):
            if job.sample is not None:
                answers.sort(key=lambda f: f.sequence)
            else:
                answers.sort(key=lambda f: -f.logprob)
        return found

    def _starts(self, slot: int, job: SlotJob) -> list[_Beam]:
        """Before the first token: one empty beam, or one per generated sequence."""
        if job.sample is None:
            start = job.grammar.start if job.grammar is not None else 0
            return [_Beam(slot, [], 0.0, "", state=start)]
        return [_Beam(slot, [], 0.0, "", sequence=j, stream=_stream(job.sample.seed, j))
                for j in range(job.sample.n)]

    def _next(self, jobs: list[SlotJob], beams: list[_Beam], logprobs: list[torch.Tensor],
              found: list[list[Found]], vocab: _Vocabulary) -> list[tuple[int, _Beam]]:
        """One step of every slot: finished answers go to ``found``; the beams that live on
        come back, slot by slot, with their parents' indices into ``beams``."""
        reads = self._reads(jobs, beams, logprobs, vocab)
        mine: dict[int, list[int]] = {}
        for i, beam in enumerate(beams):
            mine.setdefault(beam.slot, []).append(i)
        survivors: list[tuple[int, _Beam]] = []
        for s, job in enumerate(jobs):
            if s not in mine:
                continue
            own = [beams[i] for i in mine[s]]
            if job.sample is not None:
                grown = self._grow_generated(job, own, [logprobs[i] for i in mine[s]],
                                             found[s], vocab)
            else:
                grown = self._grow(job, own, [reads[i] for i in mine[s]], found[s], vocab)
            survivors += [(mine[s][parent], child) for parent, child in grown]
        return survivors

    def _reads(self, jobs: list[SlotJob], beams: list[_Beam], logprobs: list[torch.Tensor],
               vocab: _Vocabulary) -> list[_Read | None]:
        """What each searched beam's step needs of its next-token logprobs: log P(end) and
        its best continuations, worked out on the device for every beam and read back in one
        transfer (beam by beam, the host would wait on the device several times per beam).
        None for the beams of generated slots."""
        parts: list[torch.Tensor] = []
        pending = []    # per beam: (end or None when read back, top size, tokens, states)
        for beam, lp in zip(beams, logprobs, strict=True):
            job = jobs[beam.slot]
            if job.sample is not None:
                pending.append(None)
                continue
            end: float | None = None
            tokens = states = None
            top = None
            grows = len(beam.tokens) < job.max_tokens
            if job.grammar is None:
                parts.append(torch.logsumexp(lp[vocab.end_ids(job.stops)], 0).reshape(1))
                if grows:
                    _, blocked = vocab.ends(job.stops)
                    top = torch.topk(lp.masked_fill(blocked, -math.inf),
                                     min(job.beam_width, lp.shape[0]))
            else:
                ids, tokens, states = vocab.extensions(job.grammar, beam.state)
                if not job.grammar.accepts(beam.state):
                    end = -math.inf
                elif not tokens:
                    end = 0.0
                else:
                    parts.append(torch.logsumexp(lp[ids], 0).reshape(1))
                if grows and tokens:
                    top = torch.topk(lp[ids], min(job.beam_width, len(tokens)))
            if top is not None:
                parts += [top.values, top.indices]
            pending.append((end, 0 if top is None else top.values.shape[0], tokens, states))
        # fp32 logprobs and token indices are exact in float64
        values = torch.cat([p.double() for p in parts]).tolist() if parts else []
        reads: list[_Read | None] = []
        at = 0
        for beam, entry in zip(beams, pending, strict=True):
            if entry is None:
                reads.append(None)
                continue
            end, k, tokens, states = entry
            grammar = jobs[beam.slot].grammar
            if end is None:
                end = values[at]
                at += 1
                if grammar is not None:
                    end = _log1mexp(min(end, 0.0))
            picks = [int(i) for i in values[at + k:at + 2 * k]]
            top_values = values[at:at + k]
            at += 2 * k
            if grammar is None:
                reads.append(_Read(end, [(v, t, 0) for v, t in zip(top_values, picks,
                                                                    strict=True)]))
            else:
                reads.append(_Read(end, [(v, tokens[i], states[i])
                                         for v, i in zip(top_values, picks, strict=True)]))
        return reads

    def _grow(self, job: SlotJob, beams: list[_Beam], reads: list[_Read], found: list[Found],
              vocab: _Vocabulary) -> list[tuple[int, _Beam]]:
        """One step of one searched slot: its finished answers go to ``found``; the beams
        that live on come back with their parents' indices into ``beams``."""
        children: list[tuple[int, _Beam]] = []
        for i, (beam, read) in enumerate(zip(beams, reads, strict=True)):
            if read.end > -math.inf and (job.grammar is not None or beam.text.strip()):
                found.append(Found(beam.text, beam.logprob + read.end, beam.tokens))
            if len(beam.tokens) < job.max_tokens:
                children += [(i, c) for c in self._continuations(job, beam, read.top, found,
                                                                 vocab)]
        children.sort(key=lambda item: -item[1].logprob)
        # A beam only loses probability as it grows: one below the `candidates`-th answer
        # found cannot put an answer among the top ones.
        ranked = sorted((f.logprob for f in found), reverse=True)
        floor = ranked[job.candidates - 1] if len(ranked) >= job.candidates else -math.inf
        return [(i, c) for i, c in children[:job.beam_width] if c.logprob > floor]

    def _continuations(self, job: SlotJob, beam: _Beam, top: list[tuple[float, int, int]],
                       found: list[Found], vocab: _Vocabulary) -> list[_Beam]:
        """``beam``'s ``beam_width`` most likely ways on (``top``: logprob, token, grammar
        state). A text token that holds a stop after some text of its own (`September".`:
        no, it starts with the quote; `Sept.\n`: yes) ends the answer there."""
        if job.grammar is not None:
            return [_Beam(beam.slot, [*beam.tokens, token], beam.logprob + value,
                          beam.text + vocab.pieces[token], state=state)
                    for value, token, state in top]
        out = []
        for value, token, _ in top:
            if value == -math.inf:
                break
            child = self._child(job, beam, token, value)
            if isinstance(child, Found):
                if child.text.strip():
                    found.append(child)
            else:
                out.append(child)
        return out

    def _child(self, job: SlotJob, beam: _Beam, token: int, logprob: float) -> _Beam | Found:
        """``beam`` + ``token``: a longer beam, or the answer it ends (at a stop inside)."""
        tokens = [*beam.tokens, token]
        text = self._text(tokens)
        total = beam.logprob + logprob
        cut = _first_stop(text, len(beam.text), job.stops)
        if cut is not None:
            return Found(text[:cut], total, tokens, sequence=beam.sequence)
        return _Beam(beam.slot, tokens, total, text, sequence=beam.sequence, stream=beam.stream)

    def _grow_generated(self, job: SlotJob, beams: list[_Beam], logprobs: list[torch.Tensor],
                        found: list[Found], vocab: _Vocabulary) -> list[tuple[int, _Beam]]:
        """Each sequence takes its next token or ends; none is pruned."""
        ends, blocked = vocab.ends(job.stops)
        children = []
        for i, (beam, lp) in enumerate(zip(beams, logprobs, strict=True)):
            end = float(torch.logsumexp(lp[ends], 0))
            token = _draw(job.sample, end, lp.masked_fill(blocked, -math.inf), beam.stream)
            if token is None:
                found.append(Found(beam.text, beam.logprob, beam.tokens, "stop", beam.sequence))
                continue
            child = self._child(job, beam, token, float(lp[token]))
            if isinstance(child, Found):
                found.append(child)
            elif len(child.tokens) >= job.max_tokens:
                found.append(Found(child.text, child.logprob, child.tokens, "length",
                                   child.sequence))
            else:
                children.append((i, child))
        return children

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


def _draw(spec: Sampling, end: float, continuations: torch.Tensor,
          stream: torch.Generator | None) -> int | None:
    """The next token of a generated sequence, or None where it ends. ``end``: log P(the
    answer ends here); ``continuations``: the logprobs of the tokens that go on (-inf where
    a token cannot)."""
    if spec.temperature == 0:
        best = int(torch.argmax(continuations))
        return None if end >= float(continuations[best]) else best
    k = min(spec.top_k or SAMPLE_TOP_K, continuations.shape[0])
    top = torch.topk(continuations, k)
    scores = torch.cat((torch.tensor([end], dtype=torch.float64),
                        top.values.double().cpu())) / spec.temperature
    order = torch.argsort(scores, descending=True, stable=True)
    probs = torch.softmax(scores[order], 0)
    # the smallest set of the most likely holding top_p of the probability
    nucleus = int(torch.searchsorted(torch.cumsum(probs, 0),
                                     torch.tensor([spec.top_p], dtype=torch.float64))) + 1
    pick = int(torch.multinomial(probs[:min(nucleus, len(probs))], 1, generator=stream))
    chosen = int(order[pick])
    return None if chosen == 0 else int(top.indices[chosen - 1])
