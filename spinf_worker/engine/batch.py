"""One ``score_batch`` call on its way through the passes, in two halves.

``start`` prepares every request and launches its passes, reading back all but the last;
``finish`` reads back that last pass and answers every request. A caller with a stream of
batches (the queue worker) starts batch N+1 before finishing batch N: the host lays out one
while the device runs the other, as passes inside one batch already overlap
(engine/scheduler.py). Such a caller may split ``finish`` too: ``read_back`` on the thread
that runs the passes, ``respond`` (the replies, no torch) on a thread of its own, so the
next pass is laid out while this one's replies are written.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from ..completions import CompletionRequest, CompletionResponse
from ..errors import SpinfError
from ..protocol import ScoreRequest, ScoreResponse
from .completion import PreparedCompletion
from .layout import DocTree
from .respond import build_response
from .runner import DocScores
from .scheduler import PassScheduler

if TYPE_CHECKING:
    from .engine import Engine
    from .prepare import Prepared, PreparedRequest, QuerySet

PREPARE_CHUNK = 8       # requests whose contents are tokenised together (in parallel);
#                         few enough that the first pass starts early


class ScoringBatch:
    def __init__(self, engine: Engine,
                 requests: Sequence[dict | ScoreRequest | CompletionRequest]):
        self.engine, self.requests = engine, requests
        self.started = time.perf_counter()
        self.results: list[ScoreResponse | CompletionResponse | SpinfError | None] = (
            [None] * len(requests))
        self.scheduler = PassScheduler(engine.runner, engine.settings.max_pass_tokens,
                                       engine._decode_slots, engine.roots)
        self.floors: dict[tuple, DocScores] = {}   # this batch's floor values, cached or scored
        self.queued: set[tuple] = set()
        # query sets (by id, kept alive here) whose floors this batch has asked for, and
        # those whose floors are all in
        self.asked: dict[int, QuerySet] = {}
        self.floored: dict[int, QuerySet] = {}
        self.waiting: dict[int, PreparedRequest] = {}   # until every score of it is in
        self.scored: dict[int, dict[int, DocScores]] = {}
        self.completions: dict[int, PreparedCompletion] = {}   # until every prompt is done
        self.prompts_left: dict[int, int] = {}
        # the JSON of each scoring block, by object (the requests are held while the batch
        # runs): a bulk job's one block written once a batch, not once a chunk
        self.scoring_texts: dict[int, str | None] = {}
        # requests whose scores and floors are in, not answered yet: (index, request, its
        # documents' scores); answered as they come until read_back, then by respond
        self.answerable: list[tuple[int, PreparedRequest, list[DocScores]]] = []
        self.answer_at_once = True

    def _prepared(self):
        """Each request laid out, in order: scoring requests a chunk at a time (their
        contents tokenised together), completions one by one."""
        engine, chunk = self.engine, []
        for request in self.requests:
            if isinstance(request, CompletionRequest):
                if chunk:
                    yield from engine.preparer.prepare_batch(chunk, self.scoring_texts)
                    chunk = []
                try:
                    yield PreparedCompletion(engine, request)
                except SpinfError as err:
                    yield err
                continue
            chunk.append(request)
            if len(chunk) == PREPARE_CHUNK:
                yield from engine.preparer.prepare_batch(chunk, self.scoring_texts)
                chunk = []
        if chunk:
            yield from engine.preparer.prepare_batch(chunk, self.scoring_texts)

    def start(self) -> ScoringBatch:
        """Prepare and launch everything; returns with the last pass still on the device.
        Missing floor values ride in the same passes as the documents."""
        engine, scheduler = self.engine, self.scheduler
        floor_root = engine.presenter.floor_root_ids()
        for i, p in enumerate(self._prepared()):
            if isinstance(p, SpinfError):
                self.results[i] = p
                continue
            if isinstance(p, PreparedCompletion):
                self.completions[i] = p
                self.prompts_left[i] = len(p.runs)
                for k, flat in enumerate(p.docs()):
                    self._settle(scheduler.add(("prompt", (i, k)), flat))
                continue
            self.waiting[i] = p
            for k, doc in enumerate(p.docs):
                if id(doc.query_set) not in self.asked:
                    self._ask_floors(doc, floor_root)
                self._settle(scheduler.add(("doc", (i, k)), doc.flat))
        for done in scheduler.launch_waiting():
            self._settle(done)
        return self

    def _ask_floors(self, doc: Prepared, floor_root: list[int]) -> None:
        """Queue the floors of the input's query set not cached (once a batch for each set:
        a bulk job asks one set of every document)."""
        engine, qs = self.engine, doc.query_set
        self.asked[id(qs)] = qs
        for key, q, grid in zip(qs.floor_keys, doc.queries, qs.grids, strict=True):
            if key is None or key in self.floors or key in self.queued:
                continue
            if (cached := engine.floors.get(key)) is not None:
                self.floors[key] = cached
            else:
                self.queued.add(key)
                tree = DocTree(list(floor_root), engine.preparer.branches([q], [grid], key[-1]))
                self._settle(self.scheduler.add(("floor", key), tree.flatten(engine.pad_id)))

    @property
    def on_device(self) -> bool:
        """Whether its passes run apart from the host (CUDA): a launched pass has then not
        necessarily run."""
        return self.engine.device.type == "cuda"

    def wait_device(self) -> None:
        """Block until the last pass launched has run on the device, without the engine
        thread (the interpreter lock released): ``finish`` then reads it back at once, and
        the engine thread lays out the next pass meanwhile instead of waiting here."""
        if self.scheduler.in_flight is not None:
            self.scheduler.in_flight[1].wait()

    @property
    def device_seconds(self) -> float | None:
        """The device's time on this batch's passes read back so far (None on the CPU)."""
        return self.scheduler.device_s

    def finish(self) -> list[ScoreResponse | CompletionResponse | SpinfError]:
        """Wait for the last pass and answer every request."""
        self.read_back()
        return self.respond()

    def read_back(self) -> None:
        """``finish`` up to the replies: wait for the last pass and take in its scores.
        Completions decoding more than one token add a document per step: their passes run
        here until every one is done."""
        self.answer_at_once = False
        self._settle(self.scheduler.collect())
        while self.scheduler.waiting:
            for done in self.scheduler.flush():
                self._settle(done)

    def respond(self) -> list[ScoreResponse | CompletionResponse | SpinfError]:
        """Answer the requests whose scores are in (all of them, after ``read_back``). No
        torch and no device: any one thread may run it, beside the one running passes."""
        answerable, self.answerable = self.answerable, []
        engine = self.engine
        for i, prepared, scores in answerable:
            self.results[i] = build_response(prepared, scores, self.floors,
                                             model=engine.model_name,
                                             fingerprint=engine.fingerprint,
                                             started=self.started)
        return self.results

    def _prompt_done(self, i: int, k: int, doc_scores: DocScores) -> None:
        """A completion prompt's pass is in: queue its next step, or answer the request
        once its last prompt is done."""
        completion = self.completions[i]
        if (flat := completion.take(k, doc_scores)) is not None:
            self.scheduler.hold(("prompt", (i, k)), flat)
            return
        self.prompts_left[i] -= 1
        if not self.prompts_left[i]:
            self.results[i] = self.completions.pop(i).response()

    def _ready(self, i: int) -> bool:
        p = self.waiting[i]
        return len(self.scored.get(i, ())) == len(p.docs) and all(
            self._floored(d.query_set) for d in p.docs)

    def _floored(self, qs: QuerySet) -> bool:
        """Whether every floor of the query set is in."""
        if id(qs) not in self.floored:
            if not all(k is None or k in self.floors for k in qs.floor_keys):
                return False
            self.floored[id(qs)] = qs
        return True

    def _settle(self, done: list[tuple[Hashable, DocScores]]) -> None:
        """Store what finished; answer each request whose scores and floors are in (at once,
        or in ``respond`` once ``read_back`` began)."""
        engine = self.engine
        for (kind, key), doc_scores in done:
            if kind == "prompt":
                self._prompt_done(*key, doc_scores)
            elif kind == "floor":
                self.floors[key] = doc_scores
                engine.floors.put(key, doc_scores)
            else:
                self.scored.setdefault(key[0], {})[key[1]] = doc_scores
        for i in [i for i in self.scored if self._ready(i)]:
            docs = self.scored.pop(i)
            self.answerable.append((i, self.waiting.pop(i), [docs[k] for k in sorted(docs)]))
        if self.answer_at_once:
            self.respond()
