"""Completion prompts in the packed pass (POST /v1/completions).

A prompt is a document of its tokens (a string prompt: BOS + its tokens, as the model's own
tokenizer adds them; a prompt of ids: those ids as sent) laid out as blocks
(engine/prompt_blocks.py): prompts of one pass that begin with the same blocks read them once.
With ``echo`` and ``logprobs`` every row is read out (row j's fp32 log-softmax gives the
logprob of token j + 1 and the top-N at j + 1), else only the last row (the next token).
Nothing in a row's readout depends on the other documents of the pass or on the prompts that
share its blocks, so a prompt's figures are bit-identical alone, packed or shared.

Greedy decoding reads the prompt and the tokens decoded so far again for each new token (one
more document per step, its last row read out): a generated token's logprob is exactly the
one the same text would get as an echoed prompt. That costs a read of the prompt per token,
so ``max_tokens`` is small (completions.MAX_COMPLETION_TOKENS).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

from ..completions import CompletionRequest, CompletionResponse
from ..decision_rules import refuse_completion
from ..errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, SpinfError
from ..ids import new_ulid
from ..tiles import BlockChain, RowPart, padded_rows
from .layout import FlatDoc
from .prompt_blocks import Prompt, lay_out
from .runner import DocScores


def prompt_doc(ids: list[int], first: int, top: int, pad_id: int) -> FlatDoc:
    """The FlatDoc of ``ids`` read out at rows ``first..len(ids) - 1``: its blocks, which
    prompts of the same pass that begin with the same blocks share (engine/merge.py)."""
    return lay_out([Prompt(ids, first, top)], pad_id)


class TokenPieces:
    """Each token as text on its own (special tokens by their names), decoded once: a
    completion's reply spells every prompt token and every top-N token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        piece = self.known.get(token)
        if piece is None:
            piece = self.known[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return piece

    def many(self, tokens: list[int]) -> list[str]:
        known = self.known
        try:
            return [known[t] for t in tokens]
        except KeyError:
            return [self(t) for t in tokens]


@dataclass
class PromptRun:
    """One prompt on its way: its tokens, the readouts taken so far, the greedy tokens."""

    ids: list[int]
    text: str                        # the prompt's text as echoed
    offsets: list[int]               # each prompt token's character offset in ``text``
    first: int                       # the first row read out in the prompt's own pass
    read: bool = False               # the prompt's own pass is in
    token_lp: list[float | None] = field(default_factory=list)   # per prompt token (echo)
    # the top-N logprobs [R, N] and ids [R, N] of prompt tokens first + 1.. (those before
    # have none)
    top_lp: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    generated: list[int] = field(default_factory=list)
    gen_lp: list[float] = field(default_factory=list)
    gen_top: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    finish: str | None = None        # set once decoding ended
    cut: int | None = None           # the completion's text ends here (a stop string)
    eos: bool = False                # the last generated token is EOS (not in the text)


def encode_prompts(engine, request: CompletionRequest, encodings: list | None = None
                   ) -> list[tuple[list[int], str, list[int]]]:
    """Each prompt's (ids, text as echoed, each token's character offset in it); raises the
    request's own error. Once per request: laying it out keeps them for its pass.
    ``encodings``: the string prompts' tokenizer encodings, made already (encode_many)."""
    if request._encoded is not None:
        return request._encoded
    tok = engine.checkpoint.tokenizer
    vocab = int(engine.config.vocab_size)
    context = int(engine.config.max_position_embeddings)
    out = []
    for k, prompt in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{k}]"
        if isinstance(prompt, str):
            encoding = (encodings[k] if encodings is not None
                        else tok.encode(prompt, add_special_tokens=False))
            ids = [engine.checkpoint.bos_token_id, *encoding.ids]
            offsets = [0, *(start for start, _ in encoding.offsets)]
            text = prompt
        else:
            ids = list(prompt)
            if bad := [t for t in ids if t >= vocab]:
                raise InvalidRequestError(
                    f"token id {bad[0]} is outside the model's vocabulary (0-{vocab - 1})",
                    param=param)
            pieces = engine.pieces.many(ids)
            offsets = np.cumsum([0, *map(len, pieces[:-1])]).tolist()
            text = "".join(pieces)
        if len(ids) + request.max_tokens > context:
            raise ContextLengthError(
                f"the prompt is {len(ids)} tokens and {request.max_tokens} more are asked "
                f"for; the model's context is {context} tokens", param=param)
        out.append((ids, text, offsets))
    request._encoded = out
    return out


def encode_many(engine, requests: list[CompletionRequest]) -> None:
    """The string prompts of ``requests`` tokenised together, on the tokenizer's own threads
    (lm-eval sends one request per option: the queue reads many at once), each request's
    encodings kept as encode_prompts keeps them. A request with an error is left for
    encode_prompts to raise it when it is laid out."""
    todo = [r for r in requests if r._encoded is None]
    texts = [p for r in todo for p in r.prompts if isinstance(p, str)]
    if len(texts) < 2:
        return
    encodings = iter(engine.checkpoint.tokenizer.encode_batch(texts, add_special_tokens=False))
    for request in todo:
        given = [next(encodings) if isinstance(p, str) else None for p in request.prompts]
        with contextlib.suppress(SpinfError):
            encode_prompts(engine, request, given)


class PreparedCompletion:
    """A completions request laid out: one PromptRun per prompt."""

    def __init__(self, engine, request: CompletionRequest):
        self.engine, self.request = engine, request
        self.piece = engine.pieces
        model = request.model
        if model is not None and model not in engine.manifest.names:
            raise ModelNotFoundError(
                f"model {model!r} is not served here; served: {engine.model_name}",
                param="model")
        if "complete" not in engine.manifest.capabilities:
            raise refuse_completion(engine.model_name, engine.manifest.decision is not None)
        self.model = model or engine.model_name
        self.top = max(request.logprobs or 0, 1)
        echo_scores = request.echo and request.logprobs is not None
        self.runs = [PromptRun(ids, text, offsets, 0 if echo_scores else len(ids) - 1)
                     for ids, text, offsets in encode_prompts(engine, request)]

    @staticmethod
    def rows(engine, request: CompletionRequest) -> int:
        """Rows the request's first passes take, each prompt alone."""
        prepared = PreparedCompletion(engine, request)
        return sum(padded_rows(len(run.ids)) for run in prepared.runs)

    @staticmethod
    def row_parts(engine, request: CompletionRequest) -> list[RowPart]:
        """Each prompt's rows and its blocks, which the prompts of a pass share (the queue
        fills passes by these, as the packer does)."""
        prepared = PreparedCompletion(engine, request)
        return [RowPart(BlockChain.of(run.ids, prepared.top), len(run.ids), len(run.ids))
                for run in prepared.runs]

    def docs(self) -> list[FlatDoc | None]:
        """Each prompt's first document (None for a prompt with nothing to read)."""
        return [self.next_doc(run) for run in self.runs]

    def next_doc(self, run: PromptRun) -> FlatDoc | None:
        """The next document of ``run``: the prompt first, then prompt + decoded tokens."""
        if run.finish is not None:
            return None
        if not run.read:
            return prompt_doc(run.ids, run.first, self.top, self.engine.pad_id)
        ids = run.ids + run.generated
        return prompt_doc(ids, len(ids) - 1, self.top, self.engine.pad_id)

    def take(self, k: int, scores: DocScores) -> FlatDoc | None:
        """Store a pass's readouts of prompt ``k``; its next document, if decoding goes on."""
        run = self.runs[k]
        token_lp, top_lp, top_ids = scores.echo
        if not run.read:   # the prompt's own pass: row j predicts token first + j + 1
            run.read = True
            run.token_lp = [None] * (run.first + 1) + token_lp[:-1].tolist()
            run.top_lp, run.top_ids = top_lp[:-1], top_ids[:-1]
        if self.request.max_tokens == 0:
            run.finish = "length"
            return None
        token = int(top_ids[-1][0])
        run.generated.append(token)
        run.gen_lp.append(float(top_lp[-1][0]))
        run.gen_top.append((top_lp[-1], top_ids[-1]))
        if token == self.engine.checkpoint.eos_token_id:
            # EOS ends the text (it is not part of it) but keeps its logprob: evaluation
            # tools read the echoed prompt's logprobs up to the one generated token
            run.eos, run.finish = True, "stop"
            return None
        text = "".join(self.piece.many(run.generated))
        cuts = [at for s in self.request.stop if (at := text.find(s)) >= 0]
        if cuts:
            run.cut, run.finish = min(cuts), "stop"
        elif len(run.generated) >= self.request.max_tokens:
            run.finish = "length"
        return self.next_doc(run)

    # ---- the response ------------------------------------------------------------------

    def _tops(self, values: np.ndarray, ids: np.ndarray) -> list[dict[str, float]]:
        """Per row of ``values`` / ``ids`` [rows, N], its top ``logprobs`` as {piece:
        logprob}, most likely first; a piece two tokens spell keeps the first's."""
        n = self.request.logprobs
        if n == 1:   # lm-eval's: one token a row
            return [{p: v} for p, v in zip(self.piece.many(ids[:, 0].tolist()),
                                           values[:, 0].tolist(), strict=True)]
        values, ids = values[:, :n].tolist(), ids[:, :n].tolist()
        out = []
        for row_values, row_ids in zip(values, ids, strict=True):
            top = dict(zip(self.piece.many(row_ids), row_values, strict=True))
            if len(top) < len(row_ids):   # a piece twice: its first logprob
                top = {}
                for p, v in zip(self.piece.many(row_ids), row_values, strict=True):
                    top.setdefault(p, v)
            out.append(top)
        return out

    def response(self) -> CompletionResponse:
        """The reply, built as plain data (completions.CompletionResponse.of_engine)."""
        request = self.request
        choices = []
        for index, run in enumerate(self.runs):
            pieces = self.piece.many(run.generated)
            completion = "".join(pieces[:-1] if run.eos else pieces)
            n_gen = len(run.generated)
            if run.cut is not None:
                completion = completion[:run.cut]
                # the tokens that begin before the cut
                starts = np.cumsum([0, *map(len, pieces[:-1])]).tolist()
                n_gen = sum(1 for s in starts if s < run.cut)
            base = len(run.text) if request.echo else 0
            logprobs = None
            if request.logprobs is not None:
                tokens, lps, tops, offsets = [], [], [], []
                if request.echo:
                    tokens = self.piece.many(run.ids)
                    lps = list(run.token_lp)
                    tops = [None] * (len(run.ids) - len(run.top_lp))
                    tops += self._tops(run.top_lp, run.top_ids)
                    offsets = list(run.offsets)
                at = base
                for g, (piece, lp, (top_lp, top_ids)) in enumerate(zip(
                        pieces[:n_gen], run.gen_lp[:n_gen], run.gen_top[:n_gen], strict=True)):
                    tokens.append(piece)
                    lps.append(lp)
                    tops += self._tops(top_lp[None], top_ids[None])
                    offsets.append(at)
                    if not (run.eos and g == len(pieces) - 1):   # EOS takes no text
                        at += len(piece)
                logprobs = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
                            "text_offset": offsets}
            choices.append({"text": (run.text if request.echo else "") + completion,
                            "index": index, "logprobs": logprobs,
                            "finish_reason": run.finish or "length"})
        prompt_tokens = sum(len(run.ids) for run in self.runs)
        completion_tokens = sum(len(run.generated) for run in self.runs)
        return CompletionResponse.of_engine({
            "id": f"cmpl-{new_ulid()}", "object": "text_completion",
            "created": int(time.time()), "model": self.model,
            "system_fingerprint": self.engine.fingerprint, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}})
