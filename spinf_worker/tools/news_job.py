"""The news job: news articles, each cut to its first ``DOC_TOKENS`` tokens, each asked the
56 two-option questions of ``benchmarks/news_questions.json`` in one request.

Shared by ``spinf-serve bench`` and the scripts under benchmarks/ (gpu_bench.py,
cpu_news_job.py), so every figure of the job measures the same work.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from . import ToolError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from ..engine import Engine
    from ..protocol import ScoreResponse

ARTICLES = "news_articles.jsonl"
DOC_TOKENS = 470
# the questions live with the benchmarks (a checkout's file; an installed package has none)
QUESTIONS = Path(__file__).resolve().parents[2] / "benchmarks" / "news_questions.json"


def data_dir(explicit: str | Path | None = None) -> Path:
    """The shared data directory: ``explicit``, else $SPINF_SHARED_DATA, else ../shared/data
    from the working directory; a ToolError when it holds no news articles."""
    path = Path(explicit or os.environ.get("SPINF_SHARED_DATA") or Path("..") / "shared" / "data")
    if not (path / ARTICLES).is_file():
        raise ToolError(f"no {ARTICLES} in {path}: pass --data DIR or set SPINF_SHARED_DATA")
    return path


def load_docs(data: Path, tokenizer: Tokenizer, n_docs: int, doc_tokens: int = DOC_TOKENS
              ) -> list[str]:
    """The first ``n_docs`` articles, each cut to its first ``doc_tokens`` tokens."""
    docs = []
    with (data / ARTICLES).open(encoding="utf-8") as lines:
        for line in lines:
            ids = tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids
            docs.append(tokenizer.decode(ids[:doc_tokens]))
            if len(docs) == n_docs:
                break
    return docs


def load_questions(path: Path = QUESTIONS) -> dict:
    """The job's scoring block (its queries), as the questions file holds it."""
    try:
        return json.loads(path.read_text())
    except OSError as err:
        raise ToolError(f"cannot read the news questions {path}: {err.strerror or err}") from None
    except ValueError as err:
        raise ToolError(f"{path} is not JSON: {err}") from None


def build_requests(docs: Sequence[str], questions: dict, case_insensitive: bool = False
                   ) -> list[dict]:
    """One request per document, all asking the question set. Options are scored exactly as
    given unless ``case_insensitive`` (the hosted default: their case spellings too)."""
    scoring = {**questions, "case_insensitive": case_insensitive}
    return [{"text": d, "scoring": scoring} for d in docs]


def checked(responses: list) -> list:
    """The responses, or the first error among them raised."""
    for r in responses:
        if isinstance(r, Exception):
            raise r
    return responses


def tokens_read(responses: Sequence[ScoreResponse]) -> int:
    """The rows the engine laid out: content once plus the query tree (no floors)."""
    return sum(r.usage.processed_tokens for r in responses)


def questions_answered(responses: Sequence[ScoreResponse]) -> int:
    """(query, combination) pairs over every input of every response."""
    return sum(len(q.combinations) for r in responses for res in r.results for q in res.queries)


def bits(response: ScoreResponse) -> list[float]:
    """Every option logprob of a response, over its inputs, queries and combinations."""
    return [o.logprob for res in response.results for q in res.queries
            for c in q.combinations for o in c.options]


def doc_layouts(engine: Engine, requests: Sequence[dict]) -> list:
    """The laid-out inputs (FlatDoc) of the requests, as score_batch packs them."""
    return [d.flat for p in checked(engine.preparer.prepare_batch(requests)) for d in p.docs]
