"""Records the official packs' golden outputs on the default model (CPU, fp32).

For each ``fixtures/packs/<name>/docs.jsonl`` (``{"id", "text"}`` lines), scores every document
in the pack ``spinf/<name>``'s first context with the pack's queries, the way the API runs a
hosted pack, and writes ``fixtures/packs/<name>/golden.json``: per document the pack's result
queries (hosted shape) and its categories and decision. ``tests/test_pack_goldens.py`` checks
both. Re-record after changing a pack (its version is in the golden) or the model:

    .venv/bin/python scripts/record_pack_goldens.py [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "fixtures" / "packs"


def read_docs(name: str) -> list[dict]:
    path = FIXTURES / name / "docs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def golden(pack, docs: list[dict], results: list[list[dict]], model: str) -> dict:
    return {"pack": pack.id, "version": pack.version, "model": model,
            "context": next(iter(pack.contexts)), "device": "cpu",
            "docs": [{"id": d["id"], "queries": q, "packs": pack.evaluate(q, None)}
                     for d, q in zip(docs, results, strict=True)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="fixture folders (default: all)")
    args = parser.parse_args(argv)

    from spinf_worker.calibrate import engine_scorer, score_texts
    from spinf_worker.engine import Engine
    from spinf_worker.packs import find_pack, official_packs

    names = args.names or sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
    engine = Engine.load(None, device="cpu")
    score = engine_scorer(engine)
    for name in names:
        pack = find_pack(official_packs(), f"spinf/{name}")
        docs = read_docs(name)
        results = score_texts(score, pack, [d["text"] for d in docs])
        out = golden(pack, docs, results, engine.model_name)
        path = FIXTURES / name / "golden.json"
        path.write_text(json.dumps(out, indent=1) + "\n")
        unsafe = [d["packs"]["decision"]["unsafe"] for d in out["docs"]]
        print(f"{pack.group}: {len(docs)} docs -> {path.relative_to(ROOT)}; unsafe {unsafe}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
