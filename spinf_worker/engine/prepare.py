"""Requests laid out for the engine: parsed, split into their inputs, their packs' questions
added, each input's query list laid out once as a branch block, the contents presented and
tokenised.

A bulk job asks the same questions of every document, so each distinct query list (keyed by
the queries' JSON without ids) is expanded and laid out once (``QuerySet``) and reused.
"""

from __future__ import annotations

import contextlib
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..decision_rules import check_queries, check_slots
from ..errors import InvalidRequestError, ModelNotFoundError, SpinfError
from ..manifest import Decision
from ..model_names import served_names
from ..protocol import (
    DEFAULT_LIMITS,
    Document,
    Limits,
    Query,
    ScoreRequest,
    query_layout_key,
    scoring_key,
)
from ..request_limits import (
    PackRun,
    case_rule,
    case_spellings,
    check_combination_count,
    check_media_kinds,
    check_pack_ids,
    check_query_tokens,
    content_limit,
    content_too_long,
    decode_budget,
    input_param,
    pack_queries,
    pack_runs,
    past_context,
    query_params,
    scored_strings,
    too_large,
    wrapped_messages,
)
from ..templates import Combination
from ..tiles import RowPart
from .floors import floor_key
from .layout import Branch, BranchBlock, FlatDoc
from .media import MediaImage, MediaLayout
from .presentation import Presenter
from .slots import search_beams, slot_settings

__all__ = ["PackRun", "Prepared", "PreparedRequest", "Preparer", "QuerySet", "case_spellings"]

QUERY_SET_CACHE = 256   # laid-out query lists kept (bulk jobs repeat one list per document)
CHECKED_BLOCKS = 64     # scoring blocks whose shared queries passed this engine's checks
KEPT_PREPARED = 1024    # requests prepared by row_parts_many, kept for the pass that scores them


@dataclass
class QuerySet:
    """What a list of queries lays out to: the same for every document that asks it."""

    grids: list[list[Combination]]     # per query
    kinds: list[str]                   # per query its slot: "?", "*", "n" or "$"
    block: BranchBlock                 # one branch per (query, combination)
    floor_keys: list[tuple | None]     # per query (None: no floor, or an extraction slot)
    # per scored query asked case-insensitively: where each option's spellings start among
    # the branch's scored strings (None: the options themselves are scored)
    spellings: list[list[int] | None]
    one_token: list[bool]              # per query: every scored string is one token
    query_tokens: int                  # branch tokens, before prefix sharing (usage)
    floor_tokens: int                  # the same for the queries with a floor
    decode_budget: int                 # the most tokens its slots may decode (beams x steps)
    # usage's scoring, extraction and generation counts of an input asking it (respond.py)
    counts: tuple[dict, dict, dict] | None = None
    # how respond.py reads every input asking it, worked out once (respond.PlainSet)
    plain: object = None


@dataclass
class Prepared:
    """One input of a request, laid out."""

    input_id: str
    param: str                       # where the input is in the request (errors name it)
    queries: list[Query]             # the input's, then those its packs add
    n_own: int                       # queries[:n_own] are the caller's
    query_set: QuerySet
    text: str                        # the presented content (images as their token sequences)
    flat: FlatDoc | None = None      # set once the content is tokenised
    # per image (an image part's, a video frame's) its url and where it is in the request;
    # decoded when the document is laid out (engine/media.py)
    images: list[MediaImage] = field(default_factory=list)
    max_pixels: int = DEFAULT_LIMITS.max_image_pixels
    text_only: str | None = None     # with images: the content presented without them
    video_frames: int = 0            # how many of the images are a video's frames (usage)


@dataclass
class PreparedRequest:
    request: ScoreRequest
    docs: list[Prepared]
    packs: list[PackRun] = field(default_factory=list)


class Preparer:
    def __init__(self, presenter: Presenter, pad_id: int, packs: dict, *,
                 model: str, context: int, max_combinations: int,
                 max_content_tokens: int = DEFAULT_LIMITS.max_content_tokens,
                 media: MediaLayout | None = None, names: set[str] | None = None,
                 media_kinds: tuple[str, ...] | None = None, decision: Decision | None = None,
                 max_inputs: int | None = None, capabilities: tuple[str, ...] | None = None):
        """``model``: the served model's name; ``names``: every name a request may use (its
        manifest's; default: model_names.served_names). ``media``: how the model reads images
        (None: it reads text only); ``media_kinds``: those it is served with (default: all
        it reads). ``decision``: a decision model's codes and prompt format.
        ``capabilities``: the manifest's (default: all); without extract / generate, slots
        are refused."""
        self.presenter, self.pad_id, self.packs = presenter, pad_id, packs
        self.media = media
        self.names = names if names is not None else served_names(model)
        self.media_kinds = (media_kinds if media_kinds is not None
                            else media.kinds if media is not None else ())
        self.decision, self.max_inputs = decision, max_inputs
        self.capabilities = capabilities
        self.model, self.context, self.max_combinations = model, context, max_combinations
        self.max_content_tokens = max_content_tokens
        # requests prepared by row_parts_many, by object (kept with it: an id is not reused
        # while it is here), until prepare_batch takes them for their pass
        self._kept: OrderedDict[int, tuple[object, PreparedRequest]] = OrderedDict()
        self._query_sets: OrderedDict[tuple[str, ...], QuerySet] = OrderedDict()
        self._pack_queries: dict[str, list[Query]] = {}           # by pack group
        # per validated scoring block (by id; the block kept, so the id is not reused): its
        # shared queries, checked as an input asks them all without packs or own limits,
        # and their query set. A bulk job sends one block with every document.
        self._checked: dict[int, tuple[object, list[Query], QuerySet]] = {}

    def rows(self, raw: dict | ScoreRequest) -> int:
        """Rows the request's inputs take in passes, each alone (content plus the query
        set's prefix tree, each padded to the tile)."""
        return sum(part.length for part in self.row_parts(raw))

    def row_parts(self, raw: dict | ScoreRequest) -> list[RowPart]:
        """Each input's rows and what it shares with other inputs of the same content (a
        pass reads a root once: engine/merge.py), so the queue fills a pass as the packer
        will. The request's preparation is kept for the pass that scores it."""
        [parts] = self.row_parts_many([raw])
        if isinstance(parts, Exception):
            raise parts
        return parts

    def row_parts_many(self, raws: Sequence[dict | ScoreRequest],
                       kept: Callable[[FlatDoc], bool] | None = None
                       ) -> list[list[RowPart] | SpinfError]:
        """``row_parts`` of each request, a request's own error in place of its parts. Each is
        prepared whole (``prepare_batch``: parsed, its contents tokenised with the others' in
        parallel, laid out and checked) and kept for the pass that scores it, which then
        takes it as it is (the queue parses entries on a thread of their own: the thread
        running passes does not do it again). Media are decoded by that pass, not here.
        ``kept``: whether a document's root is kept from an earlier pass
        (engine/root_cache.py): its part is then its branch rows alone."""
        prepared = self._prepare(raws, media=False)
        for raw, p in zip(raws, prepared, strict=True):
            if not isinstance(p, SpinfError) and not any(d.images for d in p.docs):
                self._kept[id(raw)] = (raw, p)
        while len(self._kept) > KEPT_PREPARED:
            # one call each (no iterator): prepare_batch takes entries on another thread
            with contextlib.suppress(KeyError):
                self._kept.popitem(last=False)
        # media: equal text may hold other pixels; counted alone (merge.root_key tells)
        return [p if isinstance(p, SpinfError) else [_row_part(d, kept) for d in p.docs]
                for p in prepared]

    def prepare_batch(self, raws: Sequence[dict | ScoreRequest],
                      scoring_texts: dict[int, str | None] | None = None
                      ) -> list[PreparedRequest | SpinfError]:
        """Parse and lay out requests, their contents tokenised together (in parallel); a bad
        request yields its error in place (a bad input fails its whole request). A request
        ``row_parts_many`` prepared (the same object) is taken as it was prepared then.
        ``scoring_texts``: as ``parse`` takes it, kept by a caller preparing more requests
        of one batch a few at a time (the blocks written once a batch)."""
        out: list[PreparedRequest | SpinfError | None] = [None] * len(raws)
        fresh = []
        for i, raw in enumerate(raws):
            kept = self._kept.pop(id(raw), None)
            if kept is not None and kept[0] is raw:
                out[i] = kept[1]
            else:
                fresh.append(i)
        if fresh:
            for i, p in zip(fresh, self._prepare([raws[i] for i in fresh], scoring_texts),
                            strict=True):
                out[i] = p
        return out

    def _prepare(self, raws: Sequence[dict | ScoreRequest],
                 scoring_texts: dict[int, str | None] | None = None, *, media: bool = True
                 ) -> list[PreparedRequest | SpinfError]:
        """``prepare_batch`` of requests not prepared before; ``media``: decode and place
        their images too."""
        out: list[PreparedRequest | SpinfError] = []
        # per scoring block (a bulk job sends one): its JSON
        texts: dict[int, str | None] = {} if scoring_texts is None else scoring_texts
        for raw in raws:
            try:
                out.append(self.parse(raw, texts))
            except SpinfError as err:
                out.append(err)
        docs = [(i, d) for i, p in enumerate(out) if not isinstance(p, SpinfError)
                for d in p.docs]
        processed: dict[int, int] = {}
        texts_in = list(dict.fromkeys(d.text for _, d in docs))
        roots = dict(zip(texts_in, self.presenter.root_ids_batch(texts_in), strict=True))
        for i, doc in docs:
            root = roots[doc.text]
            doc.flat = doc.query_set.block.place(root, self.pad_id)
            if isinstance(out[i], SpinfError):
                continue
            # the content limit counts the text; media count in the processed tokens
            content = (len(root) - 1 if not doc.images else
                       len(self.presenter.root_ids_batch([doc.text_only])[0]) - 1)
            # the same checks, in the same order, as request_limits.check_request at the API
            processed[i] = processed.get(i, 0) + doc.flat.tokens + doc.query_set.decode_budget
            limit = out[i].request.effective_limits.max_processed_tokens
            if processed[i] > limit:
                out[i] = too_large(limit)
                continue
            limit = content_limit(out[i].request, self.max_content_tokens)
            if content > limit:
                out[i] = content_too_long(doc.input_id, content, limit, doc.param)
            elif doc.flat.max_position >= self.context:
                out[i] = past_context(doc.input_id, doc.flat.max_position, self.context,
                                      doc.param)
            elif doc.images and media:   # decoded last: nothing is decoded for a refused one
                try:
                    self.media.place(doc.flat, doc.images,
                                     self.media.pixels(doc.images, doc.max_pixels),
                                     doc.param)
                except SpinfError as err:
                    out[i] = err
        return out

    def parse(self, raw: dict | ScoreRequest,
              scoring_texts: dict[int, str | None] | None = None) -> PreparedRequest:
        """``scoring_texts``: the JSON of the scoring blocks parsed so far, by object (alive
        while the caller holds the requests), so that requests sharing one block write it
        once (its key among the validated blocks: protocol.ScoreRequest.parse)."""
        text = None
        if scoring_texts is not None and isinstance(raw, dict):
            block = raw.get("scoring")
            if id(block) not in scoring_texts:
                scoring_texts[id(block)] = scoring_key(raw)
            text = scoring_texts[id(block)]
        request = ScoreRequest.parse(raw, scoring_json=text)
        if request.model is not None and request.model not in self.names:
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; this engine serves {self.model!r}",
                param="model")
        if self.max_inputs is not None and len(request.inputs or ()) > self.max_inputs:
            raise InvalidRequestError(
                f"{len(request.inputs)} inputs; {self.model} takes at most {self.max_inputs} "
                "a call", param="inputs")
        # request_limits.check_request makes the same checks in the same order at the API
        runs = pack_runs(self.packs, request, self._pack_queries)
        case_insensitive = case_rule(request, runs)
        docs, limits = [], request.effective_limits
        for i, doc in enumerate(request.documents()):
            where = input_param(request, i)
            check_media_kinds(doc.messages, self.media_kinds, self.model, where)
            queries, query_set = self._queries(request, i, doc, runs, case_insensitive, limits)
            prepared = Prepared(doc.input_id, where, queries, len(doc.queries), query_set,
                                self._present(doc, runs, i))
            if self.media is not None and any(m.media_parts() for m in doc.messages):
                self._present_images(prepared, doc, runs, i, limits)
            docs.append(prepared)
        return PreparedRequest(request, docs, runs)

    def _queries(self, request: ScoreRequest, index: int, doc: Document, runs: list[PackRun],
                 case_insensitive: bool, limits: Limits) -> tuple[list[Query], QuerySet]:
        """The input's queries (its own, then its packs') checked, and their query set."""
        # without packs or limits of its own, an input asking the queries another input of
        # the same block passed (the block's shared ones, as a bulk job asks them) passes
        # again: the checks read only the queries and this engine's settings
        plain = not runs and request.limits is None
        if plain and (found := self._checked.get(id(request.scoring))) is not None:
            block, queries, query_set = found
            if (block is request.scoring and len(queries) == len(doc.queries)
                    and all(map(operator.is_, queries, doc.queries))):
                return queries, query_set
        _, params = query_params(request, index, doc)
        check_combination_count(doc.queries, params, self.max_combinations)
        queries, key = list(doc.queries), doc.layout_key
        if runs:
            check_pack_ids(doc, runs, index)
            for run in runs:
                mine = pack_queries(run.pack, self._pack_queries)
                queries += mine
                params += [None] * len(mine)   # a pack's own: no caller limits
            key = query_layout_key(queries, case_insensitive)
        if self.decision is not None:
            check_queries(self.decision, self.model, queries, params)
        elif self.capabilities is not None:
            check_slots(list(self.capabilities), self.model, queries, params)
        query_set = self._query_set(queries, key, case_insensitive, request.scoring.empty_floor,
                                    limits, params)
        if plain:
            if len(self._checked) >= CHECKED_BLOCKS:
                self._checked.clear()   # another thread's lookup then only misses
            # the block kept with its id, so that the id is not another block's
            self._checked[id(request.scoring)] = (request.scoring, queries, query_set)
        return queries, query_set

    def _present(self, doc: Document, runs: list[PackRun], index: int) -> str:
        """The input's content presented, wrapped in its packs' context."""
        return self.presenter.present(wrapped_messages(doc, runs, index))

    def _present_images(self, prepared: Prepared, doc: Document, runs: list[PackRun],
                        index: int, limits: Limits) -> None:
        """A content with images: presented with each image's token sequence where the image
        is (engine/media.py); the images are decoded when it is laid out."""
        media, where = self.media, prepared.param
        messages = where if where == "messages" else f"{where}.messages"
        prepared.images, prepared.video_frames = media.images(doc.messages, messages,
                                                              limits.max_audio_seconds)
        prepared.max_pixels = limits.max_image_pixels
        prepared.text_only = prepared.text
        prepared.text = media.expand(
            self.presenter.present(wrapped_messages(doc, runs, index, image=media.marker,
                                                    audio=media.audio_marker)),
            prepared.images, messages)

    def branches(self, queries: list[Query], grids: list[list[Combination]],
                 case_insensitive: bool = False) -> list[Branch]:
        enc = self.presenter.encode
        out = []
        for q, grid in zip(queries, grids, strict=True):
            scored = self.scored_strings(q, case_insensitive)[0] if q.slot_kind == "?" else None
            for c in grid:
                # a decision model reads each question in its own format
                prefix = self.decision.prompt.frame_question(c.prefix) if self.decision else c.prefix
                if scored is None:
                    out.append(Branch(list(enc(prefix)), [], slot_settings(q, c), q.group))
                else:
                    out.append(Branch(list(enc(prefix)), [list(enc(s)) for s in scored],
                                      group=q.group))
        return out

    def scored_strings(self, q: Query, case_insensitive: bool
                       ) -> tuple[list[str], list[int] | None]:
        """request_limits.scored_strings with this model's tokenizer."""
        return scored_strings(q, case_insensitive, self.presenter.encode)

    def _query_set(self, queries: list[Query], key: tuple[str, ...], case_insensitive: bool,
                   empty_floor: bool, limits: Limits = DEFAULT_LIMITS,
                   params: list[str | None] | None = None) -> QuerySet:
        """The queries' grids, branch layout and floor keys, built once per distinct list
        (``key``: protocol.query_layout_key; a query's id changes none of them). ``params``:
        where each query is in the request (None: a pack's, exempt from the token limits)."""
        key = (*key, f"floor={empty_floor}",
               *(() if limits == DEFAULT_LIMITS else (limits.model_dump_json(),)))
        found = self._query_sets.get(key)
        if found is not None:
            # rows() runs on the queue's parse thread while a pass prepares on the engine's:
            # the entry may be evicted between the two calls (then it is simply rebuilt later)
            with contextlib.suppress(KeyError):
                self._query_sets.move_to_end(key)
            return found
        grids = [q.combinations_list() for q in queries]
        branches = self.branches(queries, grids, case_insensitive)
        check_query_tokens(queries, grids, limits,
                           params or [f"scoring.queries.{k}" for k in range(len(queries))],
                           self.presenter.encode)
        floors = [floor_key(self.presenter.mode, q, case_insensitive)
                  if q.slot_kind == "?" and (q.empty_floor if q.empty_floor is not None
                                             else empty_floor) else None
                  for q in queries]
        sizes, one_token, at = [], [], 0
        for grid in grids:
            mine = branches[at:at + len(grid)]
            at += len(grid)
            sizes.append(sum(len(b.prefix) + sum(len(o) - 1 for o in b.options) for b in mine))
            one_token.append(bool(mine[0].options) and all(len(o) == 1 for o in mine[0].options))
        found = QuerySet(grids, [q.slot_kind for q in queries], BranchBlock.build(branches),
                         floors,
                         [self.scored_strings(q, case_insensitive)[1]
                          if q.slot_kind == "?" else None for q in queries],
                         one_token, sum(sizes),
                         sum(s for s, f in zip(sizes, floors, strict=True) if f),
                         decode_budget(queries, grids, search_beams))
        self._query_sets[key] = found
        while len(self._query_sets) > QUERY_SET_CACHE:
            self._query_sets.popitem(last=False)
        return found


def _row_part(doc: Prepared, kept: Callable[[FlatDoc], bool] | None) -> RowPart:
    """A document's rows as the queue fills passes by them: on a kept root, its branch rows
    alone, shared with the others on that root."""
    key = None if doc.images or doc.text_only is not None else ("text", doc.text)
    if key is not None and kept is not None and kept(doc.flat):
        return RowPart(("kept", key), 0, doc.flat.tokens - doc.flat.root)
    return RowPart(key, doc.flat.root, doc.flat.tokens)
