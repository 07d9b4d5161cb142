"""request_limits.check_request, as the API runs it with the tokenizer it reads
(api/tokens.py), finds exactly the error the engine finds, or none where the engine scores;
what it shares with the engine by copy stays equal; an over-budget document gets a pass of
its own."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from api import tokens as api_tokens
from spinf_worker.engine import presentation, slots
from spinf_worker.engine.scheduler import PassScheduler
from spinf_worker.errors import SpinfError
from spinf_worker.model_names import DEFAULT_MODEL
from spinf_worker.packs import official_packs
from spinf_worker.protocol import Query, ScoreRequest
from spinf_worker.request_limits import (
    branch_rows,
    check_request,
    search_beams,
    utf8_bound,
)

from .service.test_api_limits import OVER, body, query
from .test_engine_errors import BAD

MORE = [
    body(query(options=[" 1234", " no"])),
    body(query(template="7" * 256 + "{?}")),
    body(text=" a" * 50, limits={"max_content_tokens": 50}),
    body(text=" a" * 4092),
    body(text=" a" * 4096, **{"scoring": {"queries": [query(template="{?}")]}}),
    body(query(template="{x} {y}{?}", combinations="all",
               values={"x": ["red", "green"], "y": ["1", "22"]}),
         {"id": "n", "template": "\nHow many? {n}", "max_tokens": 3},
         {"id": "t", "template": 'Say "{*}"', "generate": {"n": 2}}),
    {**body(), "scoring": {"queries": [query()], "packs": [{"id": "spinf/moderation"}]}},
    {"inputs": [{"id": "a", "messages": [{"content": "One."}, {"content": "Two."}]},
                {"id": "b", "messages": [{"content": "Three."}], "query_ids": [],
                 "queries": [query(id="own", options=[" Yes", " No", " maybe so"])]}],
     "scoring": {"queries": [query()], "case_insensitive": True}},
]


@pytest.fixture(scope="module")
def served_tokens(tiny_dir):
    found = api_tokens.load(str(tiny_dir))
    assert found is not None and found.mode == "raw" and found.context == 4096
    return found


def _engine_error(engine, raw) -> SpinfError | None:
    try:
        engine.score(raw)
    except SpinfError as err:
        return err
    return None


def _api_error(raw, tokens) -> SpinfError | None:
    try:
        check_request(ScoreRequest.parse(raw), official_packs(), tokens=tokens)
    except SpinfError as err:
        return err
    return None


CASES = [case[0] for case in BAD] + [case[0] for case in OVER] + MORE


@pytest.mark.parametrize("raw", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_the_api_finds_what_the_engine_finds(tiny_engine, served_tokens, raw):
    expected = _engine_error(tiny_engine, raw)
    if expected is not None and expected.code == "model_not_served":
        return   # the API's own check, against the workers' registrations
    found = _api_error(raw, served_tokens)
    if expected is None:
        assert found is None, found.to_error()
    else:
        assert found is not None, expected.to_error()
        assert (found.status, found.to_error()) == (expected.status, expected.to_error())


def test_without_a_tokenizer_the_api_refuses_only_what_needs_none(tiny_engine):
    for raw in CASES:
        found = _api_error(raw, None)
        if found is not None:
            assert _engine_error(tiny_engine, raw).to_error() == found.to_error()


def test_a_chat_presentation_leaves_the_content_to_the_worker(served_tokens):
    chat = SimpleNamespace(encode=served_tokens.encode, mode="chat", context=4096)
    assert _api_error(body(text=" a" * 5000), chat) is None
    assert _api_error(body(query(options=[" 12345"])), chat).code == "option_too_long"


def test_branch_rows_are_the_layouts(tiny_engine):
    """The API's count of the prefix tree's rows and longest path is the layout's, groups,
    shared prefixes and sub-branches included."""
    rng = random.Random(7)
    words = [" a", " b", "7", " refund", "\nQ:", " charged", " 12"]
    for trial in range(40):
        queries = []
        for k in range(rng.randint(1, 5)):
            template = "".join(rng.choice(words) for _ in range(rng.randint(0, 6)))
            options = list(dict.fromkeys("".join(rng.choice(words) for _ in range(
                rng.randint(1, 3))) for _ in range(rng.randint(1, 4))))
            options = [o for o in options if o.strip()] or [" yes"]
            queries.append({"id": f"q{k}", "template": template + "{?}", "options": options,
                            **({"group": "g"} if rng.random() < 0.3 else {})})
        raw = {"text": "Some content.", "scoring": {"queries": queries,
                                                   "case_insensitive": trial % 2 == 0}}
        try:
            prepared = tiny_engine.preparer.parse(raw)
        except SpinfError:
            continue   # duplicates ignoring case, boundaries: not a layout
        qs = prepared.docs[0].query_set
        parsed = [Query.model_validate(q) for q in queries]
        rows, depth = branch_rows(parsed, qs.grids, tiny_engine.presenter.encode)
        assert rows == len(qs.block.ids)
        assert depth == (int(qs.block.pos.max()) + 1 if len(qs.block.ids) else 0)


def test_what_the_api_copies_from_the_engine_is_the_same():
    for top_k in range(1, 21):
        q = Query.model_validate({"id": "x", "template": "A:{*}", "top_k": top_k})
        assert search_beams(q) == slots.search_beams(q)
    assert api_tokens.INSTRUCT_NAME.pattern == presentation.INSTRUCT_NAME.pattern
    from spinf_worker.models.loader import cache_root

    assert api_tokens.cache_root() == cache_root()


def test_bytes_bound_the_tokens(served_tokens):
    """utf8_bound only ever lets the API skip a count: it must not be below the count."""
    rng = random.Random(3)
    alphabet = list("ab 7\n:?,.") + ["é", "日本", "🙂", "\u0301", "ﬁ", "\t"]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        assert len(served_tokens.encode(text)) <= utf8_bound(text)


def test_the_api_finds_a_models_files(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPINF_CACHE_DIR", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert api_tokens.model_dir(DEFAULT_MODEL) is None        # not converted yet
    default = cache / "models" / api_tokens.DEFAULT_DIR
    default.mkdir(parents=True)
    (default / api_tokens.MARKER).write_text(json.dumps({"name": "gemma-3-270m"}))
    assert api_tokens.model_dir(DEFAULT_MODEL) == default
    assert api_tokens.model_dir("spinf-12b") == default       # an alias of the default
    converted = cache / "models" / "gguf-0123456789abcdef"
    converted.mkdir()
    (converted / api_tokens.MARKER).write_text(json.dumps({"name": "Qwen3-0.6B"}))
    assert api_tokens.model_dir("Qwen3-0.6B") == converted
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (tmp_path / "hub" / "models--org--name" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--name" / "refs" / "main").write_text("abc123\n")
    assert api_tokens.model_dir("org/name") == snapshot
    assert api_tokens.model_dir("org/other") is None
    assert api_tokens.model_dir(str(tmp_path)) == tmp_path
    assert api_tokens.load("org/name") is None                # no tokenizer.json there


class _Runner:
    """A stand-in for ModelRunner that records which documents each pass holds."""

    model = SimpleNamespace(cfg=SimpleNamespace(sliding_window=512))
    pad_id = 0

    def __init__(self):
        self.passes: list[list[str]] = []

    def launch(self, docs, keep_roots=()):
        self.passes.append([d.name for d in docs])
        return SimpleNamespace(first={}, docs=docs, device_seconds=lambda: None)

    def finish(self, pending):
        return [None] * len(pending.docs)

    def starts_at_once(self):
        return False


def test_a_document_over_the_pass_budget_gets_a_pass_of_its_own():
    runner = _Runner()
    scheduler = PassScheduler(runner, 1024)
    docs = [("small-1", 256), ("huge", 4096), ("small-2", 256), ("small-3", 384),
            ("just-over", 1152), ("small-4", 128)]
    done = []
    for k, (name, rows) in enumerate(docs):
        # roots of their own (engine/merge.py merges documents that share one)
        done += scheduler.add(name, SimpleNamespace(
            name=name, length=rows, input_ids=torch.tensor([k]), root=1, tokens=1, max_position=0,
            media=[], echo=None, prompts=None))
    for batch in scheduler.flush():
        done += batch
    assert sorted(tag for tag, _ in done) == sorted(name for name, _ in docs)
    for alone in ("huge", "just-over"):
        assert [alone] in runner.passes, runner.passes
    assert all(sum(dict(docs)[n] for n in p) <= 1024 for p in runner.passes if len(p) > 1)


def test_on_the_default_model_the_api_finds_what_the_engine_finds(default_engine):
    """The API's tokenizer of the default model is the one the engine loaded (the converted
    GGUF in the cache), with its presentation and context; the checks agree with the
    engine's layout on every case, option boundaries of Gemma's tokenizer included."""
    served = api_tokens.load(DEFAULT_MODEL)
    assert served is not None
    assert (served.mode, served.context) == (default_engine.presenter.mode,
                                             default_engine.preparer.context)
    boundary = body(query(template="\n\nRefund? Answer: {?}", options=["yes", "no"]))
    for raw in [*CASES, boundary, body(text="word " * 4000)]:
        (expected,) = default_engine.preparer.prepare_batch([raw])
        if not isinstance(expected, SpinfError):
            expected = None
        elif expected.code == "model_not_served":
            continue
        found = _api_error(raw, served)
        assert (found and found.to_error()) == (expected and expected.to_error()), raw
