"""Records the official packs' golden outputs on the default model (CPU, fp32).

For each ``fixtures/packs/<name>/docs.jsonl`` (``{"id", "text"}`` lines), scores every document
with the pack ``spinf/<name>`` in the request, the way the service does, and writes
``fixtures/packs/<name>/golden.json``: per document the pack's question scores, category
scores and decision. ``tests/test_pack_goldens.py`` checks them. Re-record after changing a
pack (its version is in the golden) or the model:

    .venv/bin/python scripts/record_pack_goldens.py [NAME ...]

Each pack takes a minute or more on 2 CPU cores (the floors of every question, then the
documents); record the packs that changed, not all of them.
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


def requests(pack, docs: list[dict]) -> list[dict]:
    """A request needs one query of its own: the pack's first question, whose floor is the
    same cached value as the pack's, so it adds one branch and nothing else."""
    first = pack.questions[0]
    own = {"id": "first", "template": first.template, "options": first.options}
    return [{"text": d["text"], "scoring": {"queries": [own]}, "packs": [{"id": pack.id}]}
            for d in docs]


def outputs(responses, docs: list[dict]) -> list[dict]:
    out = []
    for doc, response in zip(docs, responses, strict=True):
        result = response.packs[0]
        out.append({"id": doc["id"],
                    "questions": {q["id"]: [q["p"], q["floor_p"]] for q in result["questions"]},
                    "categories": result["categories"], "decision": result["decision"]})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="fixture folders (default: all)")
    args = parser.parse_args(argv)

    import torch

    from spinf_worker.engine import Engine
    from spinf_worker.packs import official_packs

    names = args.names or sorted(p.name for p in FIXTURES.iterdir() if p.is_dir())
    engine = Engine.load(None, device="cpu")
    packs = official_packs()
    for name in names:
        pack = packs[f"spinf/{name}"]
        docs = read_docs(name)
        responses = engine.score_batch(requests(pack, docs))
        golden = {"pack": pack.id, "version": pack.version, "model": engine.model_name,
                  "device": "cpu", "scheme": engine.scheme, "torch": torch.__version__,
                  "threads": torch.get_num_threads(), "docs": outputs(responses, docs)}
        path = FIXTURES / name / "golden.json"
        path.write_text(json.dumps(golden, indent=1) + "\n")
        labels = [d["decision"]["label"] for d in golden["docs"]]
        print(f"{pack.id}@{pack.version}: {len(docs)} docs x {len(pack.questions)} questions "
              f"-> {path.relative_to(ROOT)}; decisions {labels}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
