"""A query's scores are bit-identical whatever else is asked of the same document: other
queries (sharing its first tokens or not, longer or shorter), before or after it, in a group
or not (CPU)."""

from __future__ import annotations

import random

import pytest

from .test_engine_parity import NEWS, QUERIES

WORDS = NEWS.replace(",", "").replace(".", "").split()
SHORT = [w for w in WORDS if len(w) <= 4]     # options of one to five tokens
TARGET = {"id": "target", "template": "\n\nIs this article about sport? Answer:{?}",
          "options": [" yes", " no"]}


def random_query(rng: random.Random, i: int) -> dict:
    """Another query: a shared "\\n\\n" start or a longer copy of the target's text, a few
    words or many, one-token or multi-token options."""
    start = rng.choice(["\n\n", "\n\nQ:", "\n\nIs this article about", "Question:", ""])
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 40)))
    options = [" " + rng.choice(SHORT) for _ in range(rng.randint(2, 4))]
    return {"id": f"q{i}", "template": f"{start}{words}?{{?}}",
            "options": list({o.lower(): o for o in options}.values())}


def target_scores(engine, queries: list[dict], group: bool = False) -> tuple:
    if group:
        for q in queries:
            q["group"] = "g" if q["id"] == "target" else None
    response = engine.score({"text": NEWS * 2, "scoring": {"queries": queries}})
    (query,) = [q for q in response.results[0].queries if q.id == "target"]
    (combination,) = query.combinations
    return tuple(o.logprob for o in combination.options), combination.residual


@pytest.mark.parametrize("seed", range(6))
def test_a_query_is_scored_alike_whatever_else_is_asked(tiny_engine, seed):
    rng = random.Random(seed)
    alone = target_scores(tiny_engine, [dict(TARGET)])
    others = [random_query(rng, i) for i in range(rng.randint(1, 12))]
    if seed % 2:
        others += [dict(q) for q in rng.sample(QUERIES, 2)]
    at = rng.randint(0, len(others))
    queries = others[:at] + [dict(TARGET)] + others[at:]
    # float equality is bit equality
    assert target_scores(tiny_engine, queries, group=seed % 3 == 0) == alone
