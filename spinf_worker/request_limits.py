"""The limits a request must keep that need the model's tokenizer or the loaded packs, in one
place and without torch: the engine's Preparer enforces them as it lays a request out, and
the API checks them with the same code before anything is queued (``check_request``, given
the served model's tokenizer: api/tokens.py).

Functions that count tokens take ``encode``: text -> token ids (no BOS), the model
tokenizer's ``encode(text, add_special_tokens=False)``. Where the API has no tokenizer it
checks only what needs none; what it checks with one is exactly what the worker would find,
in the worker's order, so it never refuses what a worker would score.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from .completions import CompletionRequest
from .errors import ContextLengthError, InvalidRequestError, RequestTooLargeError
from .media import MEDIA_PARTS, ImageText, SizedMediaText
from .pack_refs import resolve as resolve_pack
from .packs import Pack
from .protocol import (
    DEFAULT_LIMITS,
    Document,
    Limits,
    Message,
    Query,
    ScoreRequest,
    measure_audio,
    media_kinds,
)
from .templates import SCORED, Combination

Encode = Callable[[str], Sequence[int]]

BOUNDARY_TAIL = 16      # characters of a template's end checked against its options
BOUNDARY_TAILS = 8      # distinct template ends checked per query
MAX_COMBINATIONS = 10_000   # per query: EngineSettings.max_combinations' default
SEARCH_BEAMS = 6        # beams of a searched slot (engine/slots.py; a test keeps them equal)


def search_beams(q: Query) -> int:
    """Beams a searched slot runs side by side (engine/slots.search_beams)."""
    return max(SEARCH_BEAMS, q.answers_kept)


def utf8_bound(text: str) -> int:
    """An upper bound of ``text``'s tokens for the tokenizers served here (each token is at
    least one byte of the text: byte fallback or byte-level BPE). Only ever used to skip an
    exact count that could not exceed a limit, never to refuse."""
    return len(text.encode("utf-8", "surrogatepass"))


# ---- packs -----------------------------------------------------------------------------


@dataclass
class PackRun:
    """A pack a request runs: the pack, its reference (context, decision overrides), and the
    ids its queries have in the results."""

    pack: Pack
    context: str
    decision: dict | None
    include_queries: bool
    query_ids: frozenset[str]


def pack_queries(pack: Pack, cache: dict[str, list[Query]]) -> list[Query]:
    """A pack's queries (built once per pack version, in ``cache``)."""
    found = cache.get(pack.group)
    if found is None:
        found = cache[pack.group] = [Query.model_validate(q) for q in pack.queries()]
    return found


def pack_runs(packs: dict, request: ScoreRequest, cache: dict[str, list[Query]]
              ) -> list[PackRun]:
    runs = []
    for index, ref in enumerate(request.scoring.packs or []):
        pack, context = resolve_pack(packs, ref, index)
        runs.append(PackRun(pack, context, ref.decision, bool(ref.include_queries),
                            frozenset(q.id for q in pack_queries(pack, cache))))
    return runs


def case_rule(request: ScoreRequest, runs: list[PackRun]) -> bool:
    """The call's case rule; with packs, theirs (their calibration was fitted with it)."""
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


def check_pack_ids(doc: Document, runs: list[PackRun], index: int) -> None:
    """A pack's query ids and group belong to it, and the content's media are kinds the
    pack's questions were written for (its ``media``, by default text only)."""
    where = f"inputs.{index}.messages"
    for run in runs:
        for m, message in enumerate(doc.messages):
            for k, part in message.media_parts():
                kind = MEDIA_PARTS[part.type]
                if kind not in run.pack.file.media:
                    raise InvalidRequestError(
                        f"the {run.pack.id} pack reads {', '.join(run.pack.file.media)}, "
                        f"not {kind}", param=f"{where}.{m}.content.{k}.type",
                        code="pack_media_not_supported")
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


def wrapped_messages(doc: Document, runs: list[PackRun], index: int,
                     image: str | None = None, audio: str | None = None) -> list[dict]:
    """The input's messages as ``[{"role", "content": str}]``, wrapped in its packs'
    context (one context per call); ``image`` / ``audio``: the text an image / audio part is
    presented as (None: the text alone, as the content token limit counts it)."""
    messages = [{"role": m.role,
                 "content": m.text(param=f"inputs.{index}.messages.{k}", image=image,
                                   audio=audio)}
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
    return messages


def check_media_kinds(messages: list[Message], readable: Collection[str], model: str,
                      where: str) -> None:
    """``media_not_supported`` for a content with media the served model does not read
    (``readable``: the kinds it reads, e.g. ``("image",)``)."""
    missing = sorted(media_kinds(messages) - set(readable))
    if missing:
        raise InvalidRequestError(
            f"model {model} does not read {' or '.join(missing)} input here",
            param="messages" if where == "messages" else f"{where}.messages",
            code="media_not_supported")


# ---- queries ---------------------------------------------------------------------------


def input_param(request: ScoreRequest, index: int) -> str:
    """Where the input is in the request."""
    return f"inputs.{index}" if request.inputs is not None else "messages"


def query_params(request: ScoreRequest, index: int, doc: Document) -> tuple[str, list[str]]:
    """(where the input is in the request, where each of its queries is)."""
    where = input_param(request, index)
    shared = request.scoring.query_params()
    own = {q.id: f"{where}.queries.{k}" for k, q in enumerate(
        request.inputs[index].queries or [] if request.inputs is not None else [])}
    if not own:
        return where, [shared[q.id] for q in doc.queries]
    return where, [own.get(q.id) or shared[q.id] for q in doc.queries]


def check_combination_count(queries: list[Query], params: list[str],
                            max_combinations: int) -> None:
    """This server's cap on one query's combinations (EngineSettings.max_combinations)."""
    for q, param in zip(queries, params, strict=True):
        n = q.n_prompts
        if n > max_combinations:
            raise InvalidRequestError(
                f"query {q.id!r} has {n:,} combinations; this server scores at most "
                f"{max_combinations:,} per query", param=f"{param}.combinations",
                code="too_many_combinations")


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


def scored_strings(q: Query, case_insensitive: bool, encode: Encode
                   ) -> tuple[list[str], list[int] | None]:
    """The strings a scored query reads out, and where each option's spellings start among
    them (None: the options as given). Case-insensitive, an option also counts as its lower
    / Capitalised / UPPER forms with and without a leading space, those the tokenizer keeps
    as one token (the hosted API's rule)."""
    if not case_insensitive:
        return list(q.options), None
    strings, starts = [], []
    for option in q.options:
        starts.append(len(strings))
        for s in case_spellings(option):
            if s not in strings and (s == option or len(encode(s)) == 1):
                strings.append(s)
    if len(strings) == len(q.options):
        return strings, None
    return strings, starts


def check_query_tokens(queries: list[Query], grids: list[list[Combination]], limits: Limits,
                       params: list[str | None], encode: Encode, *,
                       bound: Callable[[str], int] | None = None) -> None:
    """Each filled template within the query limit, each option 1 to max_option_tokens
    tokens and read as its own tokens after the template (the hosted API's limits; a pack's
    queries, param None, are sized by its author). ``bound``: a cheap upper bound of a
    text's tokens; a text within the limit by it is not tokenised for the length check."""
    for q, grid, param in zip(queries, grids, params, strict=True):
        if param is None:
            continue
        limit = limits.max_query_tokens
        for k, c in enumerate(grid):
            if bound is not None and bound(c.prefix) <= limit:
                continue
            n = len(encode(c.prefix))
            if n > limit:
                raise InvalidRequestError(
                    f"the filled template is {n:,} tokens; the limit is {limit:,}",
                    param=f"{param}.combinations.{k}" if q.combinations
                    else f"{param}.template", code="template_too_long")
        if q.slot_kind == SCORED:
            for k, option in enumerate(q.options):
                n = len(encode(option))
                if not 1 <= n <= limits.max_option_tokens:
                    raise InvalidRequestError(
                        f"option {option!r} is {n} tokens; options are 1-"
                        f"{limits.max_option_tokens}", param=f"{param}.options.{k}",
                        code="option_too_long")
            check_boundaries(q, grid, param, encode)


def check_boundaries(q: Query, grid: list[Combination], param: str, encode: Encode) -> None:
    """Each option tokenises the same after the template's end as on its own (it is read
    as its own tokens after the template's): else the model would be asked something
    it never sees written that way (the hosted API's option_boundary)."""
    tails = list(dict.fromkeys(c.prefix[-BOUNDARY_TAIL:] for c in grid))[:BOUNDARY_TAILS]
    for tail in tails:
        if not tail:
            continue
        tail_ids = list(encode(tail))
        for k, option in enumerate(q.options):
            if list(encode(tail + option)) != tail_ids + list(encode(option)):
                raise InvalidRequestError(
                    f"option {option!r} merges with the end of the template when "
                    "tokenised; add or remove a leading space, or end the template "
                    "differently", param=f"{param}.options.{k}", code="option_boundary")


def decode_budget(queries: list[Query], grids: list[list[Combination]],
                  beams: Callable[[Query], int] = search_beams) -> int:
    """The most tokens the queries' extraction slots may decode (beams x steps)."""
    total = 0
    for q, grid in zip(queries, grids, strict=True):
        if q.slot_kind != SCORED:
            sequences = q.generation.n if q.generation is not None else beams(q)
            total += len(grid) * sequences * q.max_tokens
    return total


def branch_rows(queries: list[Query], grids: list[list[Combination]], encode: Encode
                ) -> tuple[int, int]:
    """(rows, longest path) of the queries' prefix tree below the root, exactly as
    layout.BranchBlock lays it out: per combination its template tokens, and per option of
    several tokens a sub-branch of all but its last (an option's extra case spellings are
    single tokens: no rows); a group's rows are shared only within the group."""
    children: dict[tuple[int, object], int] = {}
    deepest = 0

    def walk(tokens: Sequence[int], group: str | None) -> None:
        nonlocal deepest
        node = 0
        for tok in tokens:
            key = (node, (group, tok) if node == 0 and group is not None else tok)
            child = children.get(key)
            if child is None:
                child = children[key] = len(children) + 1
            node = child
        deepest = max(deepest, len(tokens))

    for q, grid in zip(queries, grids, strict=True):
        options = [list(encode(o)) for o in q.options] if q.slot_kind == SCORED else []
        for c in grid:
            prefix = list(encode(c.prefix))
            walk(prefix, q.group)
            for opt in options:
                if len(opt) > 1:
                    walk(prefix + opt[:-1], q.group)
    return len(children), deepest


def content_limit(request: ScoreRequest, max_content_tokens: int) -> int:
    """Content tokens an input may have: the server's limit, or the request's when lower."""
    asked = request.limits
    return min(max_content_tokens, asked.max_content_tokens
               if asked is not None else max_content_tokens)


def too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(
        f"the request needs over {limit:,} processed tokens (content, questions and "
        "decoding); split it", param="inputs")


def content_too_long(input_id: str, tokens: int, limit: int, param: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"input {input_id!r}: content is {tokens:,} tokens; the limit is {limit:,}",
        param=param, code="content_too_long")


def past_context(input_id: str, max_position: int, context: int, param: str
                 ) -> ContextLengthError:
    return ContextLengthError(
        f"input {input_id!r}: content plus the longest question is {max_position + 1} "
        f"tokens; the model's context is {context} tokens", param=param)


# ---- the whole request, as the API checks it ---------------------------------------------


@dataclass(frozen=True)
class ServedTokens:
    """What the API knows of the served model: its tokenizer's ``encode`` (no BOS), how it
    presents content ("raw": the messages joined by blank lines; "chat": its chat template,
    which the API does not render), its context in positions (None: unknown), and how it
    reads an image in its text (None: it reads none)."""

    encode: Encode
    mode: str
    context: int | None = None
    image: ImageText | SizedMediaText | None = None


def check_request(request: ScoreRequest, packs: dict, *, tokens: ServedTokens | None,
                  max_content_tokens: int = DEFAULT_LIMITS.max_content_tokens,
                  max_combinations: int = MAX_COMBINATIONS,
                  pack_cache: dict[str, list[Query]] | None = None) -> None:
    """Raise the error the engine would raise for ``request`` (already parsed), in the
    engine's order: first, input by input, the packs, combination counts and query tokens
    (Preparer.parse), then, input by input, the processed tokens, the content's and the
    context (Preparer.prepare_batch). Without ``tokens`` only what needs no tokenizer is
    checked; with a chat presentation, nothing that depends on the presented content."""
    cache = {} if pack_cache is None else pack_cache
    runs = pack_runs(packs, request, cache)
    case_rule(request, runs)
    limits = request.effective_limits
    encode = tokens.encode if tokens is not None else None
    laid_out = []
    for i, doc in enumerate(request.documents()):
        where, params = query_params(request, i, doc)
        check_combination_count(doc.queries, params, max_combinations)
        queries: list[Query] = list(doc.queries)
        if runs:
            check_pack_ids(doc, runs, i)
            for run in runs:
                mine = pack_queries(run.pack, cache)
                queries += mine
                params += [None] * len(mine)
        grids = [q.combinations_list() for q in queries]
        # an input asking the shared block as it is: its tokens checked once per block
        shared = not runs and doc.layout_key is request.scoring.layout_key()
        if encode is not None and not (shared and request.scoring._tokens_fit == (limits, encode)):
            check_query_tokens(queries, grids, limits, params, encode, bound=utf8_bound)
            if shared:
                request.scoring._tokens_fit = (limits, encode)
        # audio lengths (decoded where the header does not tell): limit and token counts
        measure_audio(doc.messages, limits, "messages" if where == "messages"
                      else f"{where}.messages")
        messages = wrapped_messages(doc, runs, i)
        full = None      # with media: the content as the model reads it, images included
        image = getattr(tokens, "image", None)
        if image is not None and media_kinds(doc.messages):
            full = image.expand("\n\n".join(
                m["content"] for m in wrapped_messages(doc, runs, i, image.marker,
                                                        image.audio_marker)), doc.messages)
        laid_out.append((doc, where, queries, grids, messages, full))
    if tokens is None or tokens.mode != "raw":
        return
    _check_content(request, laid_out, tokens, limits, content_limit(request,
                                                                    max_content_tokens))


def within_context(request: CompletionRequest, context: int) -> bool:
    """Whether every prompt plus ``max_tokens`` fits ``context`` by its bound alone (a
    string's UTF-8 bytes, an id list's length): then check_completion counts nothing."""
    return all((1 + utf8_bound(p) if isinstance(p, str) else len(p)) + request.max_tokens
               <= context for p in request.prompts)


def check_completion(request: CompletionRequest, tokens: ServedTokens | None) -> None:
    """A completion prompt (BOS + a string's tokens, or the ids as sent) plus ``max_tokens``
    past the served model's context: the 400 the worker would answer
    (engine/completion.py). Without the tokenizer or the context, the worker's alone."""
    if tokens is None or tokens.context is None:
        return
    for k, prompt in enumerate(request.prompts):
        if isinstance(prompt, str):
            # counted only where its bound could pass the context (lm-eval's prompts: never)
            if 1 + utf8_bound(prompt) + request.max_tokens <= tokens.context:
                continue
            n = 1 + len(tokens.encode(prompt))
        else:
            n = len(prompt)
        if n + request.max_tokens > tokens.context:
            raise ContextLengthError(
                f"the prompt is {n} tokens and {request.max_tokens} more are asked for; "
                f"the model's context is {tokens.context} tokens",
                param="prompt" if len(request.prompts) == 1 else f"prompt[{k}]")


def _check_content(request: ScoreRequest, laid_out: list, tokens: ServedTokens,
                   limits: Limits, content_max: int) -> None:
    """The processed tokens (content, prefix-tree rows and decoding, summed over the
    inputs), each input's content and its longest question within the context; bounds
    first, exact counts only where a bound does not settle it. The content limit counts the
    text; the processed tokens and the context count the media's tokens too (``full``)."""
    encode = tokens.encode
    limit = limits.max_processed_tokens
    texts = ["\n\n".join(m["content"] for m in laid[4]) for laid in laid_out]
    reads = [laid[5] if laid[5] is not None else text
             for laid, text in zip(laid_out, texts, strict=True)]
    bounds = [_bounds(queries, grids) for _doc, _where, queries, grids, *_ in laid_out]
    decodes = [decode_budget(queries, grids) for _doc, _where, queries, grids, *_ in laid_out]
    # BOS + content, branch rows, decoding: within the limit by the bounds, nothing to count
    exact_rows = sum(1 + utf8_bound(read) + rows + decode for read, (rows, _), decode
                     in zip(reads, bounds, decodes, strict=True)) > limit
    processed = 0
    for (doc, where, queries, grids, *_), text, read, (rows, depth), decode in zip(
            laid_out, texts, reads, bounds, decodes, strict=True):
        content = len(encode(text)) if exact_rows or utf8_bound(text) > content_max else None
        if exact_rows:
            rows, depth = branch_rows(queries, grids, encode)
            processed += 1 + (content if read is text else len(encode(read))) + rows + decode
            if processed > limit:
                raise too_large(limit)
        if content is not None and content > content_max:
            raise content_too_long(doc.input_id, content, content_max, where)
        if tokens.context is None or utf8_bound(read) + depth < tokens.context:
            continue
        if not exact_rows:
            depth = branch_rows(queries, grids, encode)[1]
        read_tokens = len(encode(read))
        if read_tokens + depth >= tokens.context:
            raise past_context(doc.input_id, read_tokens + depth, tokens.context, where)


def _bounds(queries: list[Query], grids: list[list[Combination]]) -> tuple[int, int]:
    """Upper bounds of ``branch_rows`` (rows as if no prefix were shared, the longest
    path) from the texts' bytes."""
    rows = depth = 0
    for q, grid in zip(queries, grids, strict=True):
        options = [utf8_bound(o) - 1 for o in q.options] if q.slot_kind == SCORED else [0]
        subs, longest = sum(options), max(options)
        for c in grid:
            n = utf8_bound(c.prefix)
            rows += n + subs
            depth = max(depth, n + longest)
    return rows, depth
