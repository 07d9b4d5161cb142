"""The engine: requests in, scores out.

request -> DocTree (layout) -> passes (packer) -> forward + readouts (runner) -> ScoreResponse.
floor values (the same queries over empty content) are scored once per
(presentation, query, options) in a DocTree of their own and cached, never per document.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .. import __version__
from ..errors import ContextLengthError, InvalidRequestError, ModelNotFoundError, SpinfError
from ..extract_values import grammar_for, parse_value
from ..models.loader import DEFAULT_MODEL, Checkpoint, load_checkpoint
from ..packs import Pack, PackQuestion, category_scores, decide, find_pack, official_packs
from ..protocol import (
    Candidate,
    Query,
    ScoreRequest,
    ScoreResponse,
    query_layout_key,
)
from ..templates import Combination, expand_grid
from ..tiles import padded_rows
from .decode import SlotDecoder, SlotJob
from .layout import Branch, BranchBlock, DocTree, FlatDoc
from .presentation import Presenter, choose_mode
from .runner import DocScores, ModelRunner, PendingPass
from .scheduler import PassScheduler

KERNEL_VERSION = "prefix-tree-fused-2"   # bump when a change moves any score's bits
QUERY_SET_CACHE = 256   # laid-out query lists kept (bulk jobs repeat one list per document)
ROOT_CACHE = 4096       # contents tokenised by rows(), kept for the score_batch that follows
PREPARE_CHUNK = 8       # requests whose contents are tokenised together (in parallel);
#                         few enough that the first pass starts early


@dataclass
class EngineSettings:
    max_pass_tokens: int | None = None   # None: 16384 on CUDA, 8192 on the CPU
    max_combinations: int = 1024     # per query
    floor_cache_size: int = 100_000
    presentation: str = "auto"       # auto | raw | chat
    scheme: str = "auto"             # auto | fp32 | bf16 | fp8 (W8A8; GPUs with fp8 tensor cores)
    #                                  | int8 (weight-only, per-channel scales; CPU or CUDA)
    cuda_graphs: bool = True         # CUDA: replay passes as captured graphs (engine/cuda_graphs.py)
    fuse: bool = True                # CUDA: fused projections and forward kernels (off: module by module)


@dataclass
class _QuerySet:
    """What a list of queries lays out to: the same for every document that asks it."""

    grids: list[list[Combination]]     # per query
    block: BranchBlock                 # one branch per (query, combination)
    floor_keys: list[tuple | None]     # per query (None for extraction slots)


@dataclass
class _Prepared:
    request: ScoreRequest
    queries: list[Query]             # the request's, then those its packs add
    query_set: _QuerySet
    packs: list[tuple[Pack, list[PackQuestion]]]
    text: str                        # the presented content
    flat: FlatDoc | None = None      # set once the content is tokenised


def freeze_heap() -> None:
    """For a process that keeps one engine for its life: move everything alive now (the
    model, the libraries) out of the cyclic collector's reach, so that its full collections
    stop walking that heap in the middle of a batch (on the 2-core CPU they paused a
    24-request batch for ~0.3 s now and then)."""
    gc.collect()
    gc.freeze()


def _pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _pick_scheme(scheme: str, device: torch.device) -> str:
    if scheme == "auto":
        if device.type != "cuda":
            return "fp32"
        return "fp8" if torch.cuda.get_device_capability(device) >= (8, 9) else "bf16"
    if scheme not in ("fp32", "bf16", "fp8", "int8"):
        raise ValueError(f"unknown quantisation scheme {scheme!r} (fp32, bf16, fp8, int8)")
    if scheme not in ("fp32", "int8") and device.type != "cuda":
        raise ValueError(f"scheme {scheme} runs on CUDA only; the CPU runs fp32")
    return scheme


def _init_random(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with the real shapes: for speed measurements where values don't matter."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for module in model.modules():   # norms that scale by w (not 1 + w) start at 1
        if getattr(module, "offset", None) == 0:
            module.weight.data.fill_(1.0)


class Engine:
    def __init__(self, checkpoint: Checkpoint, device: str | None = None,
                 settings: EngineSettings | None = None, packs: dict[str, Pack] | None = None):
        """``checkpoint.weights = None`` builds random weights with the real shapes; ``packs``:
        the prompt packs requests may name (default: the official ones)."""
        from ..models.registry import family_for

        self.checkpoint = checkpoint
        self.settings = replace(settings) if settings else EngineSettings()
        self.device = _pick_device(device)
        self.scheme = _pick_scheme(self.settings.scheme, self.device)
        # int8 is weight-only: activations in fp32 on the CPU, bf16 on CUDA.
        self.dtype = (torch.float32 if self.scheme == "fp32" or
                      (self.scheme == "int8" and self.device.type != "cuda") else torch.bfloat16)
        if self.settings.max_pass_tokens is None:
            self.settings.max_pass_tokens = 16384 if self.device.type == "cuda" else 8192
        family = family_for(checkpoint.config)
        self.config = family.config(checkpoint.config)
        with torch.device("meta"):
            model = family.build(self.config)
        model = model.to_empty(device=self.device).to(self.dtype)
        with torch.no_grad():
            if checkpoint.weights is None:
                _init_random(model)
            else:
                model.load_hf_weights(checkpoint.weights)
            if self.scheme == "fp8":
                model.to_fp8()
            elif self.scheme == "int8":
                from ..quant.int8 import quantize_linears

                quantize_linears(model)
        self.model = model.eval()
        self.pad_id = checkpoint.config.get("pad_token_id") or 0
        self.runner = ModelRunner(self.model, self.device, self.dtype, self.pad_id,
                                  fuse=self.settings.fuse, cuda_graphs=self.settings.cuda_graphs)
        self.packs = official_packs() if packs is None else packs
        self.decoder = SlotDecoder(self.model, checkpoint.tokenizer, checkpoint.eos_token_id,
                                   self.pad_id)
        mode = choose_mode(self.settings.presentation, checkpoint.name, checkpoint.chat_template)
        tok = checkpoint.tokenizer
        self.presenter = Presenter(tok, checkpoint.bos_token_id, mode, checkpoint.chat_template,
                                   bos_text=tok.id_to_token(checkpoint.bos_token_id) or "<bos>",
                                   eos_text=tok.id_to_token(checkpoint.eos_token_id) or "<eos>")
        self.fingerprint = self._fingerprint()
        self._floor: OrderedDict[tuple, list[DocScores]] = OrderedDict()
        self._roots: OrderedDict[str, list[int]] = OrderedDict()   # tokenised by rows()
        self._query_sets: OrderedDict[tuple[str, ...], _QuerySet] = OrderedDict()
        # per (pack, version, chosen questions): the packs are fixed, so this stays small
        self._pack_query_cache: dict[tuple, tuple[list[Query], tuple[str, ...]]] = {}

    @classmethod
    def load(cls, model: str | None = None, *, device: str | None = None,
             settings: EngineSettings | None = None, packs: dict[str, Pack] | None = None
             ) -> Engine:
        return cls(load_checkpoint(model), device=device, settings=settings, packs=packs)

    @property
    def model_name(self) -> str:
        return self.checkpoint.name

    def _fingerprint(self) -> str:
        device_class = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                        else "cpu")
        fused = self.settings.fuse and self.device.type == "cuda"   # other kernels, other bits
        parts = [self.checkpoint.weights_digest, self.scheme, __version__, KERNEL_VERSION,
                 f"threads={torch.get_num_threads()}", f"fused={fused}",
                 device_class, self.presenter.mode]
        return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    # ---- public API -------------------------------------------------------------------

    def score(self, request: dict | ScoreRequest) -> ScoreResponse:
        result = self.score_batch([request])[0]
        if isinstance(result, SpinfError):
            raise result
        return result

    def score_batch(self, requests: Sequence[dict | ScoreRequest]
                    ) -> list[ScoreResponse | SpinfError]:
        """Score many requests packed together; a bad request yields its error in place.
        Passes start while later requests are still being laid out (engine/scheduler.py);
        missing floor values ride in the same passes as the documents."""
        results: list[ScoreResponse | SpinfError | None] = [None] * len(requests)
        scheduler = PassScheduler(self.runner, self.settings.max_pass_tokens, self._decode_slots)
        floors: dict[tuple, DocScores] = {}     # this batch's floor values, cached or scored
        queued: set[tuple] = set()
        floor_root = self.presenter.floor_root_ids()
        waiting: dict[int, tuple[_Prepared, list[tuple | None]]] = {}
        scored: dict[int, DocScores] = {}

        def settle(done: list) -> None:
            """Store what finished; answer each request whose scores and floors are in."""
            for (kind, key), doc_scores in done:
                if kind == "floor":
                    floors[key] = doc_scores
                    self._remember_floor(key, doc_scores)
                else:
                    scored[key] = doc_scores
            for i in [i for i in scored if all(k is None or k in floors for k in waiting[i][1])]:
                p, keys = waiting.pop(i)
                results[i] = self._respond(p, scored.pop(i), keys, floors)

        prepared = (p for lo in range(0, len(requests), PREPARE_CHUNK)
                    for p in self._prepare_batch(requests[lo:lo + PREPARE_CHUNK]))
        for i, p in enumerate(prepared):
            if isinstance(p, SpinfError):
                results[i] = p
                continue
            keys = p.query_set.floor_keys
            for key, q, grid in zip(keys, p.queries, p.query_set.grids):
                if key is None or key in floors or key in queued:
                    continue
                if key in self._floor:
                    floors[key] = self._floor[key]
                    self._floor.move_to_end(key)
                else:
                    queued.add(key)
                    tree = DocTree(list(floor_root), self._branches([q], [grid]))
                    settle(scheduler.add(("floor", key), tree.flatten(self.pad_id)))
            waiting[i] = (p, keys)
            settle(scheduler.add(("request", i), p.flat))
        for done in scheduler.flush():
            settle(done)
        return results

    def rows(self, request: dict | ScoreRequest) -> int:
        """Rows the request's document takes in a pass (the real layout: content plus the
        query set's prefix tree, padded to the tile); the queue packs passes by this. The
        content's ids are kept for the score_batch that follows. Raises what scoring would."""
        p = self._parse(request)
        root = self.presenter.root_ids_batch([p.text])[0]
        self._roots[p.text] = root
        while len(self._roots) > ROOT_CACHE:
            self._roots.popitem(last=False)
        return padded_rows(len(root) + len(p.query_set.block.ids))

    # ---- request -> DocTree -----------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        aliases = {self.model_name, self.model_name.split("/")[-1]}
        if self.model_name == DEFAULT_MODEL:
            aliases.add("gemma-3-270m")
        if name is not None and name not in aliases:
            raise ModelNotFoundError(
                f"model {name!r} is not served here; this engine serves {self.model_name!r}",
                param="model")

    def _branches(self, queries: list[Query], grids: list[list[Combination]]) -> list[Branch]:
        enc = self.presenter.encode
        return [Branch(list(enc(c.prefix)), [list(enc(o)) for o in q.options])
                if q.slot_kind == "?" else Branch(list(enc(c.prefix)), [], _slot_settings(q, c))
                for q, grid in zip(queries, grids) for c in grid]

    def _grid(self, query: Query, index: int) -> list[Combination]:
        where = f"scoring.queries.{index}"
        return expand_grid(query.parsed_template, query.values,
                           max_combinations=self.settings.max_combinations,
                           param=f"{where}.values", template_param=f"{where}.template")

    def _prepare(self, raw: dict | ScoreRequest) -> _Prepared:
        p = self._prepare_batch([raw])[0]
        if isinstance(p, SpinfError):
            raise p
        return p

    def _prepare_batch(self, raws: Sequence[dict | ScoreRequest]) -> list[_Prepared | SpinfError]:
        """Parse and lay out requests, their contents tokenised together (in parallel); a bad
        request yields its error in place."""
        out: list[_Prepared | SpinfError] = []
        for raw in raws:
            try:
                out.append(self._parse(raw))
            except SpinfError as err:
                out.append(err)
        ok = [i for i, p in enumerate(out) if not isinstance(p, SpinfError)]
        limit = self.config.max_position_embeddings
        for i, root in zip(ok, self._root_ids([out[i].text for i in ok])):
            p = out[i]
            p.flat = p.query_set.block.place(root, self.pad_id)
            if p.flat.max_position >= limit:
                out[i] = ContextLengthError(
                    f"content plus the longest question is {p.flat.max_position + 1} tokens; "
                    f"the model's context is {limit} tokens", param="messages")
        return out

    def _root_ids(self, texts: list[str]) -> list[list[int]]:
        """BOS + ids of each text: those rows() tokenised already, the rest in parallel."""
        # pop(t, None): rows() may run on another thread (the queue parses entries while a
        # pass runs) and evict an entry at any moment
        known = {t: ids for t in texts if (ids := self._roots.pop(t, None)) is not None}
        missing = [t for t in texts if t not in known]
        known.update(zip(missing, self.presenter.root_ids_batch(missing)))
        return [known[t] for t in texts]

    def _parse(self, raw: dict | ScoreRequest) -> _Prepared:
        request = ScoreRequest.parse(raw)
        self._check_model(request.model)
        packs = [self._pack_questions(ref, i) for i, ref in enumerate(request.packs)]
        queries, key = list(request.scoring.queries), request.scoring.layout_key()
        for named, chosen in packs:
            pack_queries, pack_key = self._pack_queries(named, chosen)
            queries += pack_queries
            key += pack_key
        query_set = self._query_set(queries, key)
        messages = [{"role": m.role, "content": m.text(param=f"messages.{i}.content")}
                    for i, m in enumerate(request.content_messages())]
        return _Prepared(request, queries, query_set, packs, self.presenter.present(messages))

    def _pack_queries(self, named: Pack, chosen: list[PackQuestion]
                      ) -> tuple[list[Query], tuple[str, ...]]:
        """A pack's chosen questions as queries, and their layout key (built once)."""
        key = (named.id, named.version, *(q.id for q in chosen))
        found = self._pack_query_cache.get(key)
        if found is None:
            queries = [Query(id=f"{named.id}#{q.id}", template=q.template, options=q.options)
                       for q in chosen]
            found = self._pack_query_cache[key] = (queries, query_layout_key(queries))
        return found

    def _query_set(self, queries: list[Query], key: tuple[str, ...]) -> _QuerySet:
        """The queries' grids, branch layout and floor keys, built once per distinct list
        (``key``: protocol.query_layout_key; a query's id changes none of them)."""
        found = self._query_sets.get(key)
        if found is not None:
            self._query_sets.move_to_end(key)
            return found
        grids = [self._grid(q, i) for i, q in enumerate(queries)]
        found = _QuerySet(grids, BranchBlock.build(self._branches(queries, grids)),
                          [self._floor_key(q) if q.slot_kind == "?" else None for q in queries])
        self._query_sets[key] = found
        while len(self._query_sets) > QUERY_SET_CACHE:
            self._query_sets.popitem(last=False)
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

    # ---- floor ------------------------------------------------------------------------

    def _floor_key(self, query: Query) -> tuple:
        """A floor value is scored in a DocTree of its own, one per query, so its bits don't
        depend on the other queries."""
        return (self.presenter.mode, query.template,
                json.dumps(query.values, sort_keys=True), tuple(query.options))

    def _remember_floor(self, key: tuple, scores: DocScores) -> None:
        self._floor[key] = scores
        self._floor.move_to_end(key)
        while len(self._floor) > self.settings.floor_cache_size:
            self._floor.popitem(last=False)

    # ---- passes -----------------------------------------------------------------------

    def _decode_slots(self, pending: PendingPass, scores: list[DocScores]) -> None:
        """Decode every extraction slot of a pass together, from its kept keys and values."""
        keys, jobs = [], []
        for (i, b), first in pending.first.items():
            doc = pending.docs[i]
            _, context, settings = doc.extract[b]
            rows = torch.tensor(context)
            jobs.append(SlotJob(rows + pending.keep_base[i], doc.positions[rows], first,
                                **settings))
            keys.append((i, b))
        for (i, b), found in zip(keys, self.decoder.decode(jobs, pending.kept)):
            scores[i].found[b] = found

    # ---- DocScores -> response --------------------------------------------------------

    def _respond(self, p: _Prepared, scores: DocScores, floor_keys: list[tuple | None],
                 floors: dict[tuple, DocScores]) -> ScoreResponse:
        # Built as plain data and validated once: a bulk job answers thousands of options a
        # second, and one validation of the whole response costs ~40% less than a model
        # per option.
        query_scores, b, decoded = [], 0, 0
        for q, grid, fkey in zip(p.queries, p.query_set.grids, floor_keys):
            combos = []
            for ci, combo in enumerate(grid):
                if fkey is None:       # an extraction slot
                    found = scores.found.get(b, [])
                    decoded += sum(len(f.tokens) for f in found)
                    combos.append({"values": combo.values, "candidates": [
                        Candidate(text=text, logprob=lp, p=math.exp(lp),
                                  value=_value(q.slot_kind, text))
                        for text, lp in _merge_same_text(found)]})
                else:
                    combos.append(_option_scores(q, combo, scores, b, floors[fkey], ci))
                b += 1
            query_scores.append({"id": q.id, "combinations": combos})
        scored = p.query_set.block.n_scored + decoded
        n_own = len(p.request.scoring.queries)
        return ScoreResponse.model_validate({
            "id": f"score-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": self.model_name, "system_fingerprint": self.fingerprint,
            "usage": {"prompt_tokens": p.flat.tokens, "scored_tokens": scored,
                      "total_tokens": p.flat.tokens + scored},
            "queries": query_scores[:n_own],
            "packs": _pack_results(p.packs, query_scores[n_own:])})


def _option_scores(q: Query, combo: Combination, scores: DocScores, b: int, floor: DocScores,
                   floor_b: int) -> dict:
    """Branch b's options: logprobs, probabilities over the options, floor probabilities
    (branch floor_b of the floor's DocTree), as a CombinationScore's data."""
    lp, probs, start, residual = scores.lists
    _, floor_probs, floor_start, _ = floor.lists
    at, floor_at = start[b], floor_start[floor_b]
    return {"values": combo.values,
            "options": [{"text": o, "logprob": lp[at + k], "p": probs[at + k],
                         "floor_p": floor_probs[floor_at + k]} for k, o in enumerate(q.options)],
            "residual": residual[b]}


def _pack_results(packs: list[tuple[Pack, list[PackQuestion]]], scored: list[dict]) -> list[dict]:
    """Per requested pack: its questions' positive-option scores, categories, decision."""
    out, it = [], iter(scored)
    for named, chosen in packs:
        questions = []
        for question, score in zip(chosen, it):
            positive = next(o for o in score["combinations"][0]["options"]
                            if o["text"] == question.positive)
            questions.append({"id": question.id, "category": question.category,
                              "p": positive["p"], "floor_p": positive["floor_p"]})
        categories = category_scores(named, {q["id"]: (q["p"], q["floor_p"]) for q in questions})
        out.append({"id": named.id, "version": named.version, "questions": questions,
                    "categories": categories, "decision": decide(named, categories)})
    return out


def _value(kind: str, text: str):
    try:
        return parse_value(kind, text)
    except ValueError:   # e.g. a number too large for a float: the text still stands
        return None


def _merge_same_text(found: list) -> list[tuple[str, float]]:
    """Answers with the same text (other tokenisations, other stop tokens) are one candidate
    whose probability is their sum; most likely first."""
    merged: dict[str, float] = {}
    for f in found:
        if f.text in merged:   # log(exp(a) + exp(b)) in float64, without overflow
            a, b = sorted((merged[f.text], f.logprob))
            merged[f.text] = b + math.log1p(math.exp(a - b))
        else:
            merged[f.text] = f.logprob
    return sorted(merged.items(), key=lambda item: -item[1])


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
