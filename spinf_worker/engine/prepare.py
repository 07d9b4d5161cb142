"""Requests laid out for the engine: parsed, their packs' questions added, their query lists
laid out once as branch blocks, their contents presented and tokenised.

A bulk job asks the same questions of every document, so each distinct query list (keyed by
the queries' JSON without ids) is expanded and laid out once (``QuerySet``) and reused.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, SpinfError
from ..extract_values import grammar_for
from ..model_names import served_names
from ..packs import Pack, PackQuestion, find_pack
from ..protocol import Query, ScoreRequest, query_layout_key
from ..templates import Combination, expand_grid
from ..tiles import padded_rows
from .floors import floor_key
from .layout import Branch, BranchBlock, FlatDoc
from .presentation import Presenter

QUERY_SET_CACHE = 256   # laid-out query lists kept (bulk jobs repeat one list per document)
ROOT_CACHE = 4096       # contents tokenised by rows(), kept for the layout that follows


@dataclass
class QuerySet:
    """What a list of queries lays out to: the same for every document that asks it."""

    grids: list[list[Combination]]     # per query
    block: BranchBlock                 # one branch per (query, combination)
    floor_keys: list[tuple | None]     # per query (None for extraction slots)


@dataclass
class Prepared:
    request: ScoreRequest
    queries: list[Query]             # the request's, then those its packs add
    query_set: QuerySet
    packs: list[tuple[Pack, list[PackQuestion]]]
    text: str                        # the presented content
    flat: FlatDoc | None = None      # set once the content is tokenised


class Preparer:
    def __init__(self, presenter: Presenter, pad_id: int, packs: dict[str, Pack], *,
                 model: str, context: int, max_combinations: int):
        """``model``: the served model's name (a request may name it, or one of its aliases)."""
        self.presenter, self.pad_id, self.packs = presenter, pad_id, packs
        self.model, self.context, self.max_combinations = model, context, max_combinations
        self._roots: OrderedDict[str, list[int]] = OrderedDict()   # tokenised by rows()
        self._query_sets: OrderedDict[tuple[str, ...], QuerySet] = OrderedDict()
        # per (pack, version, chosen questions): the packs are fixed, so this stays small
        self._pack_queries: dict[tuple, tuple[list[Query], tuple[str, ...]]] = {}

    def rows(self, raw: dict | ScoreRequest) -> int:
        """Rows the request's document takes in a pass (content plus the query set's prefix
        tree, padded to the tile). The content's ids are kept for the layout that follows."""
        p = self.parse(raw)
        root = self.presenter.root_ids_batch([p.text])[0]
        self._roots[p.text] = root
        while len(self._roots) > ROOT_CACHE:
            self._roots.popitem(last=False)
        return padded_rows(len(root) + len(p.query_set.block.ids))

    def prepare_batch(self, raws: Sequence[dict | ScoreRequest]) -> list[Prepared | SpinfError]:
        """Parse and lay out requests, their contents tokenised together (in parallel); a bad
        request yields its error in place."""
        out: list[Prepared | SpinfError] = []
        for raw in raws:
            try:
                out.append(self.parse(raw))
            except SpinfError as err:
                out.append(err)
        ok = [i for i, p in enumerate(out) if not isinstance(p, SpinfError)]
        for i, root in zip(ok, self._root_ids([out[i].text for i in ok]), strict=True):
            p = out[i]
            p.flat = p.query_set.block.place(root, self.pad_id)
            if p.flat.max_position >= self.context:
                out[i] = ContextLengthError(
                    f"content plus the longest question is {p.flat.max_position + 1} tokens; "
                    f"the model's context is {self.context} tokens", param="messages")
        return out

    def parse(self, raw: dict | ScoreRequest) -> Prepared:
        request = ScoreRequest.parse(raw)
        if request.model is not None and request.model not in served_names(self.model):
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; this engine serves {self.model!r}",
                param="model")
        packs = [self._pack_questions(ref, i) for i, ref in enumerate(request.packs)]
        queries, key = list(request.scoring.queries), request.scoring.layout_key()
        for named, chosen in packs:
            pack_queries, pack_key = self._pack_query_list(named, chosen)
            queries += pack_queries
            key += pack_key
        query_set = self._query_set(queries, key)
        messages = [{"role": m.role, "content": m.text(param=f"messages.{i}.content")}
                    for i, m in enumerate(request.content_messages())]
        return Prepared(request, queries, query_set, packs, self.presenter.present(messages))

    def branches(self, queries: list[Query], grids: list[list[Combination]]) -> list[Branch]:
        enc = self.presenter.encode
        return [Branch(list(enc(c.prefix)), [list(enc(o)) for o in q.options])
                if q.slot_kind == "?" else Branch(list(enc(c.prefix)), [], _slot_settings(q, c))
                for q, grid in zip(queries, grids, strict=True) for c in grid]

    def _root_ids(self, texts: list[str]) -> list[list[int]]:
        """BOS + ids of each text: those rows() tokenised already, the rest in parallel."""
        # pop(t, None): rows() may run on another thread (the queue parses entries while a
        # pass runs) and evict an entry at any moment
        known = {t: ids for t in texts if (ids := self._roots.pop(t, None)) is not None}
        missing = [t for t in texts if t not in known]
        known.update(zip(missing, self.presenter.root_ids_batch(missing), strict=True))
        return [known[t] for t in texts]

    def _grid(self, query: Query, index: int) -> list[Combination]:
        where = f"scoring.queries.{index}"
        return expand_grid(query.parsed_template, query.values,
                           max_combinations=self.max_combinations,
                           param=f"{where}.values", template_param=f"{where}.template")

    def _query_set(self, queries: list[Query], key: tuple[str, ...]) -> QuerySet:
        """The queries' grids, branch layout and floor keys, built once per distinct list
        (``key``: protocol.query_layout_key; a query's id changes none of them)."""
        found = self._query_sets.get(key)
        if found is not None:
            # rows() runs on the queue's parse thread while a pass prepares on the engine's:
            # the entry may be evicted between the two calls (then it is simply rebuilt later)
            with contextlib.suppress(KeyError):
                self._query_sets.move_to_end(key)
            return found
        grids = [self._grid(q, i) for i, q in enumerate(queries)]
        mode = self.presenter.mode
        found = QuerySet(grids, BranchBlock.build(self.branches(queries, grids)),
                         [floor_key(mode, q) if q.slot_kind == "?" else None for q in queries])
        self._query_sets[key] = found
        while len(self._query_sets) > QUERY_SET_CACHE:
            self._query_sets.popitem(last=False)
        return found

    def _pack_query_list(self, named: Pack, chosen: list[PackQuestion]
                         ) -> tuple[list[Query], tuple[str, ...]]:
        """A pack's chosen questions as queries, and their layout key (built once)."""
        key = (named.id, named.version, *(q.id for q in chosen))
        found = self._pack_queries.get(key)
        if found is None:
            queries = [Query(id=f"{named.id}#{q.id}", template=q.template, options=q.options)
                       for q in chosen]
            found = self._pack_queries[key] = (queries, query_layout_key(queries))
        return found

    def _pack_questions(self, ref, index: int) -> tuple[Pack, list[PackQuestion]]:
        """The pack a request names, and its questions (of the categories asked for)."""
        named = find_pack(self.packs, ref.id, ref.version)
        if ref.categories is None:
            return named, list(named.questions)
        known = {c.id for c in named.categories}
        for name in ref.categories:
            if name not in known:
                raise InvalidRequestError(f"pack {named.id} has no category {name!r}",
                                          param=f"packs.{index}.categories",
                                          code="unknown_category")
        return named, [q for q in named.questions if q.category in ref.categories]


def _slot_settings(q: Query, combo: Combination) -> dict:
    """SlotJob settings of an extraction query (engine/decode.py)."""
    if q.generate is not None:
        g = q.generate
        stops = (*g.stop, combo.stop) if combo.stop else tuple(g.stop)
        return dict(stops=stops, max_tokens=g.max_tokens, beam_width=1, candidates=1,
                    sample=(g.temperature, g.seed))
    settings = dict(stops=(combo.stop, "\n") if combo.stop else ("\n",),
                    max_tokens=q.max_tokens, beam_width=q.beam_width, candidates=q.candidates)
    grammar = grammar_for(q.slot_kind)
    if grammar is not None:
        settings.update(allowed=grammar.prefix_ok, complete=grammar.complete)
    return settings
