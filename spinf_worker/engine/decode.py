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
from typing import ClassVar

import torch

from ..extract_values import ValueGrammar
from ..tiles import BRANCH_TILE, ROW_TILE
from .top_tokens import strict_top

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


def context_width(lengths: torch.Tensor) -> torch.Tensor:
    """The width a slot's context of ``lengths`` entries is padded to on the CPU: whole row
    tiles, a function of the slot's own length alone."""
    return -(-lengths // ROW_TILE) * ROW_TILE


@dataclass
class DecodePlan:
    """Attention for decoding steps (the model calls ``attend`` once per layer)."""

    decoding: ClassVar[bool] = True    # a step's few rows: its GEMMs take a step's tiles
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]]   # per layer: the pass's kept K, V
    ctx_rows: torch.Tensor           # [slots, L]: each slot's context, rows into ``kept``
    ctx_pos: torch.Tensor            # [slots, L]: their positions
    ctx_ok: torch.Tensor             # [slots, L]: real entries (a slot's first ctx_len)
    ctx_len: torch.Tensor            # [slots]
    window: int
    beam_slot: torch.Tensor = None   # [beams]
    q_pos: torch.Tensor = None       # [beams]: positions of this step's tokens
    # per layer [steps, rows, Hkv, D]: each step's generated keys (values), beam b's at row b
    # of its step; capacity grown by doubling, so a step writes its own rows and copies none
    gen_k: dict[int, torch.Tensor] = field(default_factory=dict)
    gen_v: dict[int, torch.Tensor] = field(default_factory=dict)
    gen_rows: torch.Tensor = None    # [beams, t]: the rows of the steps holding its tokens
    gen_pos: torch.Tensor = None     # [beams, t]: their positions
    step_rows: torch.Tensor = None   # [beams, t + 1]: gen_rows and this step's own rows
    step_pos: torch.Tensor = None    # [beams, t + 1]: gen_pos and this step's q_pos
    max_steps: int = 8               # the most steps decoded (the buffers grow no further)
    chunks: dict[int, torch.Tensor] = field(default_factory=dict)   # CUDA: beams by slot,
    # once a step for all layers (per chunk size: a model's layers may group heads apart)

    def attend(self, q, k, v, *, layer: int, sliding: bool, scale: float) -> torch.Tensor:
        n = self.beam_slot.shape[0]
        q, k, v = q[:n], k[:n], v[:n]
        t = self.gen_rows.shape[1]
        gk, gv = self._reserve(layer, k, t + 1, n)
        gk[t, :n], gv[t, :n] = k, v
        kept_k, kept_v = self.kept[layer]
        out = q.new_zeros(-(-n // ROW_TILE) * ROW_TILE, *q.shape[1:])
        gen_pos = self.step_pos
        if q.is_cuda:   # a slot's beams read its context once (kernels/decode_attention.py)
            from ..kernels.decode_attention import beam_chunks, beams_per_program, decode_attention

            beams = beams_per_program(q.shape[1] // kept_k.shape[1])
            if beams not in self.chunks:
                self.chunks[beams] = beam_chunks(self.beam_slot, beams)
            decode_attention(q, kept_k, kept_v, gk, gv, self.step_rows, self.ctx_rows,
                             self.ctx_pos, self.ctx_len, gen_pos, self.beam_slot, self.q_pos,
                             self.window if sliding else None, scale, out, self.chunks[beams])
            return out
        # A beam's products have a shape of its own: BRANCH_TILE beams at a time, over a context
        # padded to its slot's own width (context_width), so its bits never depend on the
        # other slots decoded beside it (their context lengths, their number).
        widths = context_width(self.ctx_len)[self.beam_slot]
        steps = torch.arange(t + 1, device=q.device)
        for width in torch.unique(widths).tolist():
            chosen = torch.nonzero(widths == width).flatten()
            for lo in range(0, chosen.shape[0], BRANCH_TILE):
                tile = chosen[lo:lo + BRANCH_TILE]
                real = tile.shape[0]
                tile = torch.cat((tile, tile[:1].expand(BRANCH_TILE - real)))
                own = (steps[None, :], self.step_rows[tile])   # each beam's tokens in order
                o = self._attend_tile(q[tile], kept_k, kept_v, gk[own], gv[own],
                                      gen_pos[tile], tile, width, sliding, scale)
                out[tile[:real]] = o[:real]
        return out

    def _attend_tile(self, q, kept_k, kept_v, gk, gv, gen_pos, beams, width: int,
                     sliding: bool, scale: float) -> torch.Tensor:
        """CPU: one tile of beams over their slots' contexts (``width`` entries) and their
        own generated tokens."""
        slots = self.beam_slot[beams]
        rows = self.ctx_rows[slots, :width]
        keys = torch.cat((kept_k[rows], gk), 1)
        values = torch.cat((kept_v[rows], gv), 1)
        pos = torch.cat((self.ctx_pos[slots, :width], gen_pos), 1)
        ok = torch.cat((self.ctx_ok[slots, :width],
                        torch.ones(q.shape[0], gk.shape[1], dtype=torch.bool,
                                   device=q.device)), 1)
        if sliding:
            ok &= (self.q_pos[beams][:, None] - pos) < self.window
        n, hkv = q.shape[0], keys.shape[2]
        qg = q.view(n, hkv, -1, q.shape[-1])
        s = torch.einsum("nkgd,nlkd->nkgl", qg, keys) * scale
        s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
        return torch.einsum("nkgl,nlkd->nkgd", torch.softmax(s, -1), values).reshape(q.shape)

    def _reserve(self, layer: int, like: torch.Tensor, steps: int, rows: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key and value buffers, grown (doubling the steps) to hold ``steps``
        steps of ``rows`` rows; what they held is kept in place."""
        old = self.gen_k.get(layer)
        if old is not None and old.shape[0] >= steps and old.shape[1] >= rows:
            return old, self.gen_v[layer]
        have = (0, 0) if old is None else old.shape[:2]
        if steps > have[0]:     # doubled, up to the most steps this decode can take
            steps = max(steps, min(max(2 * have[0], 8), self.max_steps))
        shape = (max(steps, have[0]), max(rows, have[1]), *like.shape[1:])
        for store in (self.gen_k, self.gen_v):
            grown = like.new_empty(shape)
            if old is not None:
                grown[:have[0], :have[1]] = store[layer]
            store[layer] = grown
        return self.gen_k[layer], self.gen_v[layer]

    def begin_step(self) -> None:
        """Before a step's forward: where its beams' tokens are and their positions, once
        for all layers (this step's own token: row b of its step for beam b)."""
        n = self.beam_slot.shape[0]
        own = torch.arange(n, device=self.q_pos.device)[:, None]
        self.step_rows = torch.cat((self.gen_rows, own), 1)
        self.step_pos = torch.cat((self.gen_pos, self.q_pos[:, None]), 1)
        self.chunks = {}

    def advance(self, parents: torch.Tensor) -> None:
        """Keep the beams ``parents`` (indices into this step's beams), in that order: by
        their row lists, their keys and values staying where they are."""
        self.gen_rows = self.step_rows[parents]
        self.gen_pos = self.step_pos[parents]
        self.beam_slot = self.beam_slot[parents]
        self.q_pos = self.q_pos[parents] + 1


@dataclass
class _Read:
    """A searched beam's step, read back from the device: log P(the answer ends here) and
    its most likely continuations (logprob, token, the grammar's state after it)."""

    end: float
    top: list[tuple[float, int, int]]
    texts: list[str] | None = None   # a text beam: each continuation's decoded text


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


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A host list of ints on ``device`` without the host waiting for the device (pinned,
    asynchronous; a pageable copy would wait for the work queued before it)."""
    t = torch.tensor(values, dtype=torch.long)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _logsumexp_rows(x: torch.Tensor) -> torch.Tensor:
    """log(sum(exp)) of each row of ``x`` [rows, n] in float64, each row's bits its own: on
    the CPU torch.logsumexp row by row; on CUDA, whose reductions split a row by how many
    rows there are, a pairwise sum of a fixed order."""
    if x.shape[1] == 0:
        return torch.full((x.shape[0],), -math.inf, dtype=torch.float64, device=x.device)
    if not x.is_cuda:
        return torch.stack([torch.logsumexp(row, 0) for row in x]).double()
    return _pairwise_logsumexp(x)


def _pairwise_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``_logsumexp_rows`` from elementwise operations alone: the row's max, then its terms
    added in pairs (column j to j + half) until one is left."""
    top = x.amax(1, keepdim=True).double()             # a max is exact in any order
    top = torch.where(torch.isinf(top), 0.0, top)      # a row of -inf sums to 0: -inf
    terms = torch.exp(x.double() - top)
    width = 1 << (x.shape[1] - 1).bit_length()
    terms = torch.nn.functional.pad(terms, (0, width - x.shape[1]))
    while terms.shape[1] > 1:
        half = terms.shape[1] // 2
        terms = terms[:, :half] + terms[:, half:]
    return terms[:, 0].log() + top[:, 0]


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
        width = int(context_width(torch.tensor([j.context_rows.shape[0] for j in jobs])).max())
        rows = torch.zeros(len(jobs), width, dtype=torch.long)
        ok = torch.zeros(len(jobs), width, dtype=torch.bool)
        pos = torch.zeros(len(jobs), width, dtype=torch.long)
        for i, j in enumerate(jobs):
            n = j.context_rows.shape[0]
            rows[i, :n], ok[i, :n], pos[i, :n] = j.context_rows, True, j.context_pos
        dev = next(self.model.parameters()).device
        rows, ok, pos = rows.to(dev), ok.to(dev), pos.to(dev)
        lengths = torch.tensor([j.context_rows.shape[0] for j in jobs], device=dev)
        plan = DecodePlan(kept, rows, pos, ok, lengths, self.model.cfg.sliding_window,
                          max_steps=max(j.max_tokens for j in jobs))
        vocab = self._vocab(int(jobs[0].first_logprobs.shape[-1]), dev)
        found: list[list[Found]] = [[] for _ in jobs]
        starts = [b for s, job in enumerate(jobs) for b in self._starts(s, job)]
        # the first step reads the pass's own logprobs: a slot's row serves all its beams
        firsts = torch.stack([job.first_logprobs.to(dev) for job in jobs])
        beams = [b for _, b in self._next(jobs, starts, firsts, [b.slot for b in starts],
                                          found, vocab)]
        next_pos = [int(j.context_pos.max()) + 1 for j in jobs]
        plan.gen_pos = torch.zeros(len(beams), 0, dtype=torch.long, device=dev)
        plan.gen_rows = torch.zeros(len(beams), 0, dtype=torch.long, device=dev)
        plan.beam_slot = _on_device([b.slot for b in beams], dev)
        plan.q_pos = _on_device([next_pos[b.slot] for b in beams], dev)
        while beams:
            logprobs = self._step(beams, plan)
            survivors = self._next(jobs, beams, logprobs, list(range(len(beams))), found,
                                   vocab)
            beams = [b for _, b in survivors]
            if beams:
                plan.advance(_on_device([i for i, _ in survivors], dev))
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

    def _next(self, jobs: list[SlotJob], beams: list[_Beam], logprobs: torch.Tensor,
              rows: list[int], found: list[list[Found]], vocab: _Vocabulary
              ) -> list[tuple[int, _Beam]]:
        """One step of every slot (beam i's next-token logprobs: ``logprobs[rows[i]]``):
        finished answers go to ``found``; the beams that live on come back, slot by slot,
        with their parents' indices into ``beams``."""
        reads = self._reads(jobs, beams, logprobs, rows, vocab)
        self._decode_texts(jobs, beams, reads)
        mine: dict[int, list[int]] = {}
        for i, beam in enumerate(beams):
            mine.setdefault(beam.slot, []).append(i)
        survivors: list[tuple[int, _Beam]] = []
        for s, job in enumerate(jobs):
            if s not in mine:
                continue
            own = [beams[i] for i in mine[s]]
            if job.sample is not None:
                grown = self._grow_generated(job, own, [logprobs[rows[i]] for i in mine[s]],
                                             found[s], vocab)
            else:
                grown = self._grow(job, own, [reads[i] for i in mine[s]], found[s], vocab)
            survivors += [(mine[s][parent], child) for parent, child in grown]
        return survivors

    def _reads(self, jobs: list[SlotJob], beams: list[_Beam], logprobs: torch.Tensor,
               rows: list[int], vocab: _Vocabulary) -> list[_Read | None]:
        """What each searched beam's step needs of its next-token logprobs: log P(end) and
        its best continuations. Beams that need the same columns (text beams of one set of
        stops; value beams in one grammar state) are worked out together on the device, and
        everything is read back in one transfer: per beam, the host would launch a dozen
        kernels and the device would idle between them. None for generated slots' beams."""
        size = logprobs.shape[1]
        ends: dict[tuple, list[int]] = {}    # the columns of P(end) -> beams
        tops: dict[tuple, list[int]] = {}    # the columns a beam may go on with, k -> beams
        known: dict[int, float] = {}         # beams whose P(end) the grammar alone says
        for i, beam in enumerate(beams):
            job = jobs[beam.slot]
            if job.sample is not None:
                continue
            grows = len(beam.tokens) < job.max_tokens
            if job.grammar is None:
                ends.setdefault((job.stops,), []).append(i)
                if grows:
                    tops.setdefault((job.stops, min(job.beam_width, size)), []).append(i)
                continue
            _, tokens, _ = vocab.extensions(job.grammar, beam.state)
            if not job.grammar.accepts(beam.state):
                known[i] = -math.inf
            elif not tokens:
                known[i] = 0.0
            else:
                ends.setdefault((job.grammar, beam.state), []).append(i)
            if grows and tokens:
                tops.setdefault((job.grammar, beam.state, min(job.beam_width, len(tokens))),
                                []).append(i)
        groups = [*ends.values(), *tops.values()]
        if not groups:
            return [None if jobs[b.slot].sample is not None else _Read(known[i], [])
                    for i, b in enumerate(beams)]
        index = _on_device([rows[i] for group in groups for i in group], logprobs.device)
        parts: list[torch.Tensor] = []
        at = 0
        for key, members in ends.items():   # only the group's rows and columns are copied
            columns = (vocab.end_ids(key[0]) if len(key) == 1
                       else vocab.extensions(*key)[0])
            mine = logprobs[index[at:at + len(members), None], columns]
            at += len(members)
            parts.append(_logsumexp_rows(mine))
        for key, members in tops.items():
            if len(key) == 2:
                mine = logprobs.index_select(0, index[at:at + len(members)])
                mine.masked_fill_(vocab.ends(key[0])[1], -math.inf)   # a copy: its own
            else:
                columns = vocab.extensions(*key[:2])[0]
                mine = logprobs[index[at:at + len(members), None], columns]
            at += len(members)
            values, picks = strict_top(mine, key[-1])
            parts += [values.double().flatten(), picks.double().flatten()]
        # fp32 logprobs and token indices are exact in float64
        read = torch.cat(parts).tolist()
        end = dict(known)
        at = 0
        for key, members in ends.items():
            for i, value in zip(members, read[at:at + len(members)], strict=True):
                end[i] = value if len(key) == 1 else _log1mexp(min(value, 0.0))
            at += len(members)
        top: dict[int, list[tuple[float, int, int]]] = {}
        for key, members in tops.items():
            k = key[-1]
            values, picks = read[at:at + k * len(members)], read[at + k * len(members):
                                                               at + 2 * k * len(members)]
            at += 2 * k * len(members)
            for n, i in enumerate(members):
                mine = zip(values[n * k:(n + 1) * k], picks[n * k:(n + 1) * k], strict=True)
                if len(key) == 2:
                    top[i] = [(v, int(t), 0) for v, t in mine]
                else:
                    _, tokens, states = vocab.extensions(*key[:2])
                    top[i] = [(v, tokens[int(c)], states[int(c)]) for v, c in mine]
        return [None if jobs[b.slot].sample is not None else _Read(end[i], top.get(i, []))
                for i, b in enumerate(beams)]

    def _decode_texts(self, jobs: list[SlotJob], beams: list[_Beam],
                      reads: list[_Read | None]) -> None:
        """The text of every continuation of every text beam, decoded in one call."""
        sequences, owners = [], []
        for beam, read in zip(beams, reads, strict=True):
            if read is None or jobs[beam.slot].grammar is not None:
                continue
            owners.append(read)
            for value, token, _ in read.top:
                if value == -math.inf:
                    break
                sequences.append([*beam.tokens, token])
        texts = (self.tokenizer.decode_batch(sequences, skip_special_tokens=False)
                 if sequences else [])
        at = 0
        for read in owners:
            n = sum(1 for value, _, _ in read.top if value > -math.inf)
            read.texts, at = texts[at:at + n], at + n

    def _grow(self, job: SlotJob, beams: list[_Beam], reads: list[_Read], found: list[Found],
              vocab: _Vocabulary) -> list[tuple[int, _Beam]]:
        """One step of one searched slot: its finished answers go to ``found``; the beams
        that live on come back with their parents' indices into ``beams``."""
        children: list[tuple[int, _Beam]] = []
        for i, (beam, read) in enumerate(zip(beams, reads, strict=True)):
            if read.end > -math.inf and (job.grammar is not None or beam.text.strip()):
                found.append(Found(beam.text, beam.logprob + read.end, beam.tokens))
            if len(beam.tokens) < job.max_tokens:
                children += [(i, c) for c in self._continuations(job, beam, read, found,
                                                                 vocab)]
        children.sort(key=lambda item: -item[1].logprob)
        # A beam only loses probability as it grows: one below the `candidates`-th answer
        # found cannot put an answer among the top ones.
        ranked = sorted((f.logprob for f in found), reverse=True)
        floor = ranked[job.candidates - 1] if len(ranked) >= job.candidates else -math.inf
        return [(i, c) for i, c in children[:job.beam_width] if c.logprob > floor]

    def _continuations(self, job: SlotJob, beam: _Beam, read: _Read, found: list[Found],
                       vocab: _Vocabulary) -> list[_Beam]:
        """``beam``'s ``beam_width`` most likely ways on (``read.top``: logprob, token,
        grammar state). A text token that holds a stop after some text of its own
        (`September".`: no, it starts with the quote; `Sept.\\n`: yes) ends the answer
        there."""
        if job.grammar is not None:
            return [_Beam(beam.slot, [*beam.tokens, token], beam.logprob + value,
                          beam.text + vocab.pieces[token], state=state)
                    for value, token, state in read.top]
        out = []
        # texts stop where the continuations do (at the first -inf)
        for (value, token, _), text in zip(read.top, read.texts, strict=False):
            child = self._child(job, beam, token, value, text)
            if isinstance(child, Found):
                if child.text.strip():
                    found.append(child)
            else:
                out.append(child)
        return out

    def _child(self, job: SlotJob, beam: _Beam, token: int, logprob: float,
               text: str | None = None) -> _Beam | Found:
        """``beam`` + ``token`` (whose text is ``text`` when already decoded): a longer beam,
        or the answer it ends (at a stop inside)."""
        tokens = [*beam.tokens, token]
        if text is None:
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
        ids = _on_device([b.tokens[-1] for b in beams] + [self.pad_id] * (padded - n), dev)
        pos = torch.zeros(padded, dtype=torch.long, device=dev)
        pos[:n] = plan.q_pos
        plan.begin_step()
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
