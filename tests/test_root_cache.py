"""Roots kept across passes and calls (engine/root_cache.py): a document sent again is laid out
as its branch rows alone on its root's kept keys and values, and every response is bit for
bit the one the engine gives without kept roots: other questions of the same content, merged
with partners on the kept root, packed beside other contents, past the sliding window, and
after the least recently used roots were dropped (CPU: the default model and the tiny Gemma 3,
whose sliding window every document here passes)."""

from __future__ import annotations

import pytest

from spinf_worker.engine.root_cache import RootCache

from .test_engine_parity import NEWS, QUERIES
from .test_root_merge import PassLog, comparable

BY_ID = {q["id"]: q for q in QUERIES}
OTHER = ("Heavy rain flooded the valley overnight; the river rose two metres and the mayor "
         "closed the old bridge until engineers can inspect it.")


def request(content: str, *ids: str) -> dict:
    return {"messages": [{"role": "user", "content": content}],
            "scoring": {"queries": [BY_ID[i] for i in ids]}}


@pytest.fixture
def keeping(request):
    """The engine named by the test's parameter with kept roots on (a budget of ``mib``), and
    the same engine's responses without them."""
    engine = request.getfixturevalue(request.param)
    old_roots, old_pass = engine.roots, engine.settings.max_pass_tokens

    def on(mib: int = 64) -> RootCache:
        engine.roots = RootCache(mib << 20)
        return engine.roots

    yield engine, on
    engine.roots, engine.settings.max_pass_tokens = old_roots, old_pass


def without_kept(engine, requests: list[dict]) -> list[tuple]:
    roots, engine.roots = engine.roots, None
    try:
        return [comparable(engine.score(r)) for r in requests]
    finally:
        engine.roots = roots


@pytest.mark.parametrize("keeping", ["default_engine", "tiny_engine"], indirect=True)
def test_a_document_sent_again_reads_only_its_questions(keeping, monkeypatch):
    engine, on = keeping
    first, again = request(NEWS, "topic", "tone"), request(NEWS, "actor", "about")
    want = without_kept(engine, [first, again])
    roots = on()
    log = PassLog(engine.runner, monkeypatch)
    assert comparable(engine.score(first)) == want[0]
    assert len(roots) >= 1 and not any(d.kept_root for d in log.passes[0])
    rows_before = sum(d.tokens for d in log.passes[0])
    assert comparable(engine.score(again)) == want[1]
    [docs] = log.passes[1:]
    kept = [d for d in docs if d.kept_root is not None]
    # the content's root is not in the pass: only the questions' rows are
    assert len(kept) == 1 and kept[0].root == 0
    prepared = engine.preparer.prepare_batch([again])[0].docs[0].flat
    assert kept[0].tokens == prepared.tokens - prepared.root
    assert kept[0].kept_root.rows == prepared.root
    assert sum(d.tokens for d in docs) < rows_before


@pytest.mark.parametrize("keeping", ["default_engine", "tiny_engine"], indirect=True)
def test_kept_roots_keep_every_bit_merged_and_packed(keeping):
    """Requests on a kept root, two of them merged on it in one pass, beside documents whose
    roots are read in the same pass, at several places in the batch."""
    engine, on = keeping
    engine.settings.max_pass_tokens = 1 << 20        # one pass a call
    batch = [request(NEWS, "tone"), request(OTHER, "topic", "tone"), request(NEWS, "actor"),
             request(NEWS + " Rates rose.", "about"), request(NEWS, "topic", "about")]
    want = without_kept(engine, batch)
    on()
    engine.score(request(NEWS, "topic"))            # keeps NEWS's root
    for rotation in range(3):
        order = batch[rotation:] + batch[:rotation]
        got = [comparable(r) for r in engine.score_batch(order)]
        assert got == want[rotation:] + want[:rotation], rotation


@pytest.mark.parametrize("keeping", ["tiny_engine"], indirect=True)
def test_the_least_recently_used_roots_go_first(keeping):
    engine, on = keeping
    contents = [f"{OTHER} Report {k}: the water kept rising near house {k}." for k in range(4)]
    asked = [request(c, "tone") for c in contents]
    want = without_kept(engine, asked)
    roots = on()
    engine.score(asked[0])
    one_root = roots.bytes
    assert one_root > 0
    roots.max_bytes = 2 * one_root + one_root // 2    # room for two of these roots
    for r in asked[1:]:
        engine.score(r)
    assert len(roots) == 2 and roots.bytes <= roots.max_bytes
    hits = roots.hits
    # the first two were dropped; each is read again, kept again, and scores as before
    assert [comparable(engine.score(r)) for r in asked] == want
    assert roots.hits == hits + 0 and len(roots) == 2


@pytest.mark.parametrize("keeping", ["default_engine"], indirect=True)
def test_a_template_read_out_at_the_roots_last_row_is_not_kept(keeping, monkeypatch):
    """A query with no text before its slot reads out at the root's last row, which a kept
    root does not hold: its document reads its root every time, and scores as before."""
    engine, on = keeping
    bare = request(NEWS, "bare", "tone")
    want = without_kept(engine, [bare])
    on()
    log = PassLog(engine.runner, monkeypatch)
    assert comparable(engine.score(bare)) == want[0]
    assert comparable(engine.score(bare)) == want[0]
    assert not any(d.kept_root for docs in log.passes for d in docs)


@pytest.mark.parametrize("keeping", ["tiny_engine"], indirect=True)
def test_the_queue_counts_a_kept_root_at_its_branch_rows(keeping):
    """``row_parts_many`` (what a worker fills its passes by) counts a document on a kept root
    at its branch rows, shared with the others on that root; one whose root is not kept, as
    before."""
    engine, on = keeping
    again, other = request(NEWS, "actor", "about"), request(OTHER, "tone")
    [[before], [other_before]] = engine.row_parts_many([again, other])
    on()
    engine.score(request(NEWS, "topic"))
    [[part], [other_part]] = engine.row_parts_many([again, other])
    assert part.key == ("kept", before.key) and part.root == 0
    assert part.tokens == before.tokens - before.root
    assert other_part == other_before


@pytest.mark.parametrize("keeping", ["default_engine", "tiny_engine"], indirect=True)
def test_extraction_slots_decode_from_a_kept_root(keeping, monkeypatch):
    """A document with extraction slots on a kept root: its slots decode from the kept root's
    keys and values and their branch's, and answer as without kept roots (two such documents
    in one pass too)."""
    from .test_root_merge import COUNT

    engine, on = keeping
    asked = {"messages": [{"role": "user", "content": NEWS}],
             "scoring": {"queries": [COUNT, BY_ID["tone"]]}}
    other = {"messages": [{"role": "user", "content": OTHER}],
             "scoring": {"queries": [COUNT]}}
    want = without_kept(engine, [asked, other])
    on()
    log = PassLog(engine.runner, monkeypatch)
    engine.score_batch([request(NEWS, "topic"), request(OTHER, "topic")])   # keeps both roots
    got = [comparable(r) for r in engine.score_batch([asked, other])]
    assert got == want
    docs = log.passes[-1]
    assert sum(1 for d in docs if d.kept_root is not None and d.extract) == 2
    answers = [q.combinations[0].answers for q in engine.score(asked).results[0].queries[:1]]
    assert answers == [want[0][0][0].queries[0].combinations[0].answers]
