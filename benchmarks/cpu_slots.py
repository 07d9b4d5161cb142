"""Extraction slots on the CPU news job: questions/s with and without four slots per
document, and the decoding work per slot, in one run.

    python benchmarks/cpu_slots.py --docs 24 --out benchmarks/results

Each slot is searched for its ``top_k`` 4 answers within ``max_tokens``; the decoded tokens
are the responses' ``usage.completion_tokens``. Options are scored exactly as given
(``"case_insensitive": false``) unless ``--case-insensitive`` (the hosted default).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cpu_news_job import (  # noqa: E402
    ROOT,
    cpu_model,
    load_articles,
    option_logprobs,
    scoring_block,
    sh,
)

from spinf_worker.engine import Engine  # noqa: E402

SLOTS = [
    {"id": "country", "template": "\n\nQ: Which country is this article mainly about?\nA:{*}",
     "top_k": 4, "max_tokens": 8},
    {"id": "person", "template": "\n\nQ: Who is the first person named in the article?\nA:{*}",
     "top_k": 4, "max_tokens": 8},
    {"id": "count", "template": "\n\nQ: What is the first number mentioned in the article?\nA:{n}",
     "top_k": 4, "max_tokens": 8},
    {"id": "money", "template": "\n\nQ: What sum of money is mentioned first?\nA:{$}",
     "top_k": 4, "max_tokens": 10},
]


def timed(engine: Engine, docs: list[str], block: dict) -> tuple[float, list]:
    engine.score_batch([{"text": docs[0][:200], "scoring": block}])    # floors, warm caches
    t0 = time.perf_counter()
    responses = engine.score_batch([{"text": d, "scoring": block} for d in docs])
    return time.perf_counter() - t0, responses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--case-insensitive", action="store_true",
                        help="the hosted default: options over their case spellings")
    args = parser.parse_args()
    engine = Engine.load(None, device="cpu")
    docs = load_articles(engine, args.docs)
    questions = scoring_block(args.case_insensitive)
    plain_s, plain = timed(engine, docs, questions)
    slots_s, with_slots = timed(engine, docs, {**questions,
                                               "queries": questions["queries"] + SLOTS})
    for r in plain + with_slots:
        if isinstance(r, Exception):
            raise r
    decoded = sum(r.usage.completion_tokens for r in with_slots)
    scored_q = len(questions["queries"]) * len(docs)
    n_slots = len(SLOTS) * len(docs)
    n_q = len(questions["queries"])
    same = all(option_logprobs(a) == option_logprobs(b)
               for a, b in zip(plain, with_slots, strict=True))
    answered = sum(bool(c.answers) for r in with_slots for q in r.results[0].queries[n_q:]
                   for c in q.combinations)
    commit = sh("git rev-parse --short HEAD")
    row = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": cpu_model(),
           "docs": len(docs), "questions_per_doc": len(questions["queries"]),
           "slots_per_doc": len(SLOTS), "case_insensitive": args.case_insensitive,
           "questions_per_s_without_slots": round(scored_q / plain_s, 2),
           "questions_per_s_with_slots": round((scored_q + n_slots) / slots_s, 2),
           "seconds_without_slots": round(plain_s, 2), "seconds_with_slots": round(slots_s, 2),
           "decode_seconds_per_slot": round((slots_s - plain_s) / n_slots, 3),
           "decoded_tokens_per_slot": round(decoded / n_slots, 1),
           "slots_with_an_answer": answered,
           "scores_unchanged_by_slots": same}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{row['date']}-cpu-slots-{commit}.json").write_text(json.dumps(row, indent=1))
    for k, v in row.items():
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
