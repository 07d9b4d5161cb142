"""Requests laid out for the engine: parsed, split into their inputs, their packs' questions
added, each input's query list laid out once as a branch block, the contents presented and
tokenised.

A bulk job asks the same questions of every document, so each distinct query list (keyed by
the queries' JSON without ids) is expanded and laid out once (``QuerySet``) and reused.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import (
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
    SpinfError,
)
from ..model_names import served_names
from ..pack_refs import resolve as resolve_pack
from ..packs import Pack
from ..protocol import DEFAULT_LIMITS, Document, Limits, Query, ScoreRequest, query_layout_key
from ..templates import Combination
from ..tiles import padded_rows
from .floors import floor_key
from .layout import Branch, BranchBlock, FlatDoc
from .presentation import Presenter
from .slots import search_beams, slot_settings

QUERY_SET_CACHE = 256   # laid-out query lists kept (bulk jobs repeat one list per document)
ROOT_CACHE = 4096       # contents tokenised by rows(), kept for the layout that follows
BOUNDARY_TAIL = 16      # characters of a template's end checked against its options
BOUNDARY_TAILS = 8      # distinct template ends checked per query


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


@dataclass
class Prepared:
    """One input of a request, laid out."""

    input_id: str
    param: str                       # where the input is in the request (errors name it)
    queries: list[Query]             # the input's, then those its packs add
    n_own: int                       # queries[:n_own] are the caller's
    query_set: QuerySet
    text: str                        # the presented content
    flat: FlatDoc | None = None      # set once the content is tokenised


@dataclass
class PackRun:
    """A pack a request runs: the pack, its reference (context, decision overrides), and the
    ids its queries have in the results."""

    pack: Pack
    context: str
    decision: dict | None
    include_queries: bool
    query_ids: frozenset[str]


@dataclass
class PreparedRequest:
    request: ScoreRequest
    docs: list[Prepared]
    packs: list[PackRun] = field(default_factory=list)


class Preparer:
    def __init__(self, presenter: Presenter, pad_id: int, packs: dict, *,
                 model: str, context: int, max_combinations: int,
                 max_content_tokens: int = DEFAULT_LIMITS.max_content_tokens):
        """``model``: the served model's name (a request may name it, or one of its aliases)."""
        self.presenter, self.pad_id, self.packs = presenter, pad_id, packs
        self.model, self.context, self.max_combinations = model, context, max_combinations
        self.max_content_tokens = max_content_tokens
        self._roots: OrderedDict[str, list[int]] = OrderedDict()   # tokenised by rows()
        self._query_sets: OrderedDict[tuple[str, ...], QuerySet] = OrderedDict()
        self._pack_queries: dict[str, list[Query]] = {}           # by pack group

    def rows(self, raw: dict | ScoreRequest) -> int:
        """Rows the request's inputs take in passes (content plus the query set's prefix
        tree, each padded to the tile). The contents' ids are kept for the layout that
        follows."""
        p = self.parse(raw)
        roots = self.presenter.root_ids_batch([d.text for d in p.docs])
        for doc, root in zip(p.docs, roots, strict=True):
            self._roots[doc.text] = root
        while len(self._roots) > ROOT_CACHE:
            self._roots.popitem(last=False)
        return sum(padded_rows(len(root) + len(d.query_set.block.ids))
                   for d, root in zip(p.docs, roots, strict=True))

    def prepare_batch(self, raws: Sequence[dict | ScoreRequest]
                      ) -> list[PreparedRequest | SpinfError]:
        """Parse and lay out requests, their contents tokenised together (in parallel); a bad
        request yields its error in place (a bad input fails its whole request)."""
        out: list[PreparedRequest | SpinfError] = []
        for raw in raws:
            try:
                out.append(self.parse(raw))
            except SpinfError as err:
                out.append(err)
        docs = [(i, d) for i, p in enumerate(out) if not isinstance(p, SpinfError)
                for d in p.docs]
        processed: dict[int, int] = {}
        for (i, doc), root in zip(docs, self._root_ids([d.text for _, d in docs]), strict=True):
            doc.flat = doc.query_set.block.place(root, self.pad_id)
            if isinstance(out[i], SpinfError):
                continue
            processed[i] = processed.get(i, 0) + doc.flat.tokens + doc.query_set.decode_budget
            limit = out[i].request.effective_limits.max_processed_tokens
            if processed[i] > limit:
                out[i] = RequestTooLargeError(
                    f"the request needs over {limit:,} processed tokens (content, questions and "
                    "decoding); split it", param="inputs")
                continue
            asked = out[i].request.limits
            limit = min(self.max_content_tokens, asked.max_content_tokens
                        if asked is not None else self.max_content_tokens)
            if len(root) - 1 > limit:
                out[i] = InvalidRequestError(
                    f"input {doc.input_id!r}: content is {len(root) - 1:,} tokens; the limit is "
                    f"{limit:,}", param=doc.param, code="content_too_long")
            elif doc.flat.max_position >= self.context:
                out[i] = ContextLengthError(
                    f"input {doc.input_id!r}: content plus the longest question is "
                    f"{doc.flat.max_position + 1} tokens; the model's context is "
                    f"{self.context} tokens", param=doc.param)
        return out

    def parse(self, raw: dict | ScoreRequest) -> PreparedRequest:
        request = ScoreRequest.parse(raw)
        if request.model is not None and request.model not in served_names(self.model):
            raise ModelNotFoundError(
                f"model {request.model!r} is not served here; this engine serves {self.model!r}",
                param="model")
        runs = [self._pack_run(ref, i) for i, ref in enumerate(request.scoring.packs or [])]
        case_insensitive = self._case_insensitive(request, runs)
        docs, limits = [], request.effective_limits
        shared = {q.id: f"scoring.queries.{k}" for k, q in enumerate(request.scoring.queries)}
        for i, doc in enumerate(request.documents()):
            where = f"inputs.{i}" if request.inputs is not None else "messages"
            own = {q.id: f"{where}.queries.{k}" for k, q in enumerate(
                request.inputs[i].queries or [] if request.inputs is not None else [])}
            params = [own.get(q.id) or shared[q.id] for q in doc.queries]
            self._check_combination_count(doc.queries, params)
            queries, key = list(doc.queries), doc.layout_key
            if runs:
                self._check_pack_ids(doc, runs, i)
                for run in runs:
                    pack_queries = self._pack_query_list(run.pack)
                    queries += pack_queries
                    params += [None] * len(pack_queries)   # a pack's own: no caller limits
                key = query_layout_key(queries, case_insensitive)
            query_set = self._query_set(queries, key, case_insensitive,
                                        request.scoring.empty_floor, limits, params)
            docs.append(Prepared(doc.input_id, where, queries, len(doc.queries), query_set,
                                 self._present(doc, runs, i)))
        return PreparedRequest(request, docs, runs)

    def _check_combination_count(self, queries: list[Query], params: list[str]) -> None:
        """This server's cap on one query's combinations (EngineSettings.max_combinations)."""
        for q, param in zip(queries, params, strict=True):
            n = q.n_prompts
            if n > self.max_combinations:
                raise InvalidRequestError(
                    f"query {q.id!r} has {n:,} combinations; this server scores at most "
                    f"{self.max_combinations:,} per query", param=f"{param}.combinations",
                    code="too_many_combinations")

    def _present(self, doc: Document, runs: list[PackRun], index: int) -> str:
        """The input's content presented, wrapped in its packs' context."""
        messages = [{"role": m.role, "content": m.text(param=f"inputs.{index}.messages.{k}")}
                    for k, m in enumerate(doc.messages)]
        wraps = set()
        for run in runs:
            try:
                wraps.add(run.pack.wrap(run.context, doc.parameters))
            except InvalidRequestError as err:
                err.param = err.param or f"inputs.{index}.parameters"
                raise
        if len(wraps) > 1:
            raise InvalidRequestError(
                "the packs of this call wrap the content in different contexts; send one "
                "pack per call", param="scoring.packs", code="pack_conflict")
        if wraps:
            ((before, after),) = wraps
            messages[0]["content"] = before + messages[0]["content"]
            messages[-1]["content"] += after
        return self.presenter.present(messages)

    def branches(self, queries: list[Query], grids: list[list[Combination]],
                 case_insensitive: bool = False) -> list[Branch]:
        enc = self.presenter.encode
        out = []
        for q, grid in zip(queries, grids, strict=True):
            scored = self.scored_strings(q, case_insensitive)[0] if q.slot_kind == "?" else None
            for c in grid:
                if scored is None:
                    out.append(Branch(list(enc(c.prefix)), [], slot_settings(q, c), q.group))
                else:
                    out.append(Branch(list(enc(c.prefix)), [list(enc(s)) for s in scored],
                                      group=q.group))
        return out

    def scored_strings(self, q: Query, case_insensitive: bool
                       ) -> tuple[list[str], list[int] | None]:
        """The strings a scored query reads out, and where each option's spellings start
        among them (None: the options as given). Case-insensitive, an option also counts as
        its lower / Capitalised / UPPER forms with and without a leading space, those the
        tokenizer keeps as one token (the hosted API's rule)."""
        if not case_insensitive:
            return list(q.options), None
        strings, starts = [], []
        for option in q.options:
            starts.append(len(strings))
            for s in case_spellings(option):
                if s not in strings and (s == option or len(self.presenter.encode(s)) == 1):
                    strings.append(s)
        if len(strings) == len(q.options):
            return strings, None
        return strings, starts

    def _case_insensitive(self, request: ScoreRequest, runs: list[PackRun]) -> bool:
        """The call's setting; with packs, theirs (their calibration was fitted with it)."""
        if not runs:
            return request.scoring.ignores_case
        settings = {run.pack.case_insensitive for run in runs}
        if len(settings) > 1:
            raise InvalidRequestError("the packs of a call must share one case rule",
                                      param="scoring.packs", code="pack_conflict")
        rule = settings.pop()
        asked = request.scoring.case_insensitive
        if asked is not None and asked != rule:
            raise InvalidRequestError(
                f"scoring.case_insensitive differs from the packs' ({str(rule).lower()}); "
                "leave it out", param="scoring.case_insensitive", code="pack_conflict")
        return rule

    def _check_pack_ids(self, doc: Document, runs: list[PackRun], index: int) -> None:
        """A pack's query ids and group belong to it."""
        own = {q.id for q in doc.queries}
        groups = {run.pack.group for run in runs}
        for q in doc.queries:
            if q.group in groups:
                raise InvalidRequestError(f"{q.group!r} is the query group of a pack of this "
                                          "call", param=f"inputs.{index}.queries",
                                          code="reserved_group")
        for run in runs:
            clash = sorted(own & run.query_ids)
            if clash:
                raise InvalidRequestError(
                    f"query id {clash[0]!r} belongs to the {run.pack.id} pack",
                    param=f"inputs.{index}.queries", code="duplicate_id")

    def _root_ids(self, texts: list[str]) -> list[list[int]]:
        """BOS + ids of each text: those rows() tokenised already, the rest in parallel."""
        # pop(t, None): rows() may run on another thread (the queue parses entries while a
        # pass runs) and evict an entry at any moment
        known = {t: ids for t in texts if (ids := self._roots.pop(t, None)) is not None}
        missing = list(dict.fromkeys(t for t in texts if t not in known))
        known.update(zip(missing, self.presenter.root_ids_batch(missing), strict=True))
        return [known[t] for t in texts]

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
        self._check_tokens(queries, grids, branches, limits,
                           params or [f"scoring.queries.{k}" for k in range(len(queries))])
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
                         self._decode_budget(queries, grids))
        self._query_sets[key] = found
        while len(self._query_sets) > QUERY_SET_CACHE:
            self._query_sets.popitem(last=False)
        return found

    @staticmethod
    def _decode_budget(queries: list[Query], grids: list[list[Combination]]) -> int:
        total = 0
        for q, grid in zip(queries, grids, strict=True):
            if q.slot_kind != "?":
                sequences = q.generation.n if q.generation is not None else search_beams(q)
                total += len(grid) * sequences * q.max_tokens
        return total

    def _check_tokens(self, queries: list[Query], grids: list[list[Combination]],
                      branches: list[Branch], limits: Limits, params: list[str | None]) -> None:
        """Each filled template within the query limit, each option 1 to max_option_tokens
        tokens (the hosted API's limits; a pack's queries are sized by its author)."""
        at = 0
        for q, grid, param in zip(queries, grids, params, strict=True):
            mine, at = branches[at:at + len(grid)], at + len(grid)
            if param is None:
                continue
            for k, branch in enumerate(mine):
                if len(branch.prefix) > limits.max_query_tokens:
                    raise InvalidRequestError(
                        f"the filled template is {len(branch.prefix):,} tokens; the limit is "
                        f"{limits.max_query_tokens:,}", param=f"{param}.combinations.{k}"
                        if q.combinations else f"{param}.template", code="template_too_long")
            if q.slot_kind == "?":
                for k, option in enumerate(q.options):
                    n = len(self.presenter.encode(option))
                    if not 1 <= n <= limits.max_option_tokens:
                        raise InvalidRequestError(
                            f"option {option!r} is {n} tokens; options are 1-"
                            f"{limits.max_option_tokens}", param=f"{param}.options.{k}",
                            code="option_too_long")
                self._check_boundaries(q, grid, param)

    def _check_boundaries(self, q: Query, grid: list[Combination], param: str) -> None:
        """Each option tokenises the same after the template's end as on its own (it is read
        as its own tokens after the template's): else the model would be asked something
        it never sees written that way (the hosted API's option_boundary)."""
        enc = self.presenter.encode
        tails = list(dict.fromkeys(c.prefix[-BOUNDARY_TAIL:] for c in grid))[:BOUNDARY_TAILS]
        for tail in tails:
            if not tail:
                continue
            tail_ids = list(enc(tail))
            for k, option in enumerate(q.options):
                if list(enc(tail + option)) != tail_ids + list(enc(option)):
                    raise InvalidRequestError(
                        f"option {option!r} merges with the end of the template when "
                        "tokenised; add or remove a leading space, or end the template "
                        "differently", param=f"{param}.options.{k}", code="option_boundary")

    def _pack_run(self, ref, index: int) -> PackRun:
        pack, context = resolve_pack(self.packs, ref, index)
        queries = self._pack_query_list(pack)
        return PackRun(pack, context, ref.decision, bool(ref.include_queries),
                       frozenset(q.id for q in queries))

    def _pack_query_list(self, pack: Pack) -> list[Query]:
        """A pack's queries (built once per pack version)."""
        found = self._pack_queries.get(pack.group)
        if found is None:
            found = self._pack_queries[pack.group] = [Query.model_validate(q)
                                                      for q in pack.queries()]
        return found


def case_spellings(option: str) -> list[str]:
    """The option as given, then its lower / Capitalised / UPPER forms, each with and without
    a leading space, without repeats."""
    base = option.strip()
    out = [option]
    for form in (base.lower(), base[:1].upper() + base[1:].lower(), base.upper()):
        for s in (" " + form, form):
            if s not in out:
                out.append(s)
    return out
