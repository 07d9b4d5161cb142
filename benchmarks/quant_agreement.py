"""Agreement of a quantised scheme with the fp32 reference on the news job (CPU).

The first ``--docs`` articles of ``../shared/data/news_articles.jsonl`` (each cut to its first
470 tokens) x the 56 two-option questions of ``news_questions.json``, scored once in fp32 and
once in ``--scheme`` on the same weights. Reports, over every (document, question): mean and
max |Δp| of the options' renormalised probabilities, top-1 agreement, mean and max |Δlogprob|
and |Δfloor_p|, and writes them as JSON (the calibration record of a quantisation recipe).

    python benchmarks/quant_agreement.py --docs 8 --scheme int8 \
        --out quantizations/google--gemma-3-270m/calibration.json
    python benchmarks/quant_agreement.py --docs 8 --scheme fp8-static \
        --fp8-scales quantizations/google--gemma-3-270m/fp8-static-scales.safetensors \
        --out quantizations/google--gemma-3-270m/calibration-fp8-static.json

fp8-static runs its exact CPU reference path (quant/fp8_static.py): fp8 values multiplied
in fp32, the same quantised arithmetic as the GPU kernels up to the order of the sums.

Options are scored exactly as given (``"case_insensitive": false``, as the recorded
calibrations were) unless ``--case-insensitive`` (the hosted default); the JSON says which.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
ARTICLES = ROOT.parent / "shared" / "data" / "news_articles.jsonl"
QUESTIONS = ROOT / "benchmarks" / "news_questions.json"
DOC_TOKENS = 470


def main() -> None:
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.models.loader import load_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the packaged Gemma 3 270M")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--scheme", default="int8")
    parser.add_argument("--fp8-scales", default=None,
                        help="fp8-static: the activation scales file (spinf-serve quantize)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--case-insensitive", action="store_true",
                        help="the hosted default: options over their case spellings")
    args = parser.parse_args()

    ckpt = load_checkpoint(args.model)
    ref = Engine(ckpt, device="cpu", settings=EngineSettings(scheme="fp32"))
    quant = Engine(ckpt, device="cpu", settings=EngineSettings(scheme=args.scheme,
                                                               fp8_scales=args.fp8_scales))
    lines = ARTICLES.read_text(encoding="utf-8").splitlines()[: args.docs]
    docs = [ckpt.tokenizer.decode(list(ref.presenter.encode(json.loads(x)["text"])[:DOC_TOKENS]))
            for x in lines]
    block = {**json.loads(QUESTIONS.read_text()), "case_insensitive": args.case_insensitive}
    requests = [{"text": d, "scoring": block} for d in docs]

    seconds = {}
    responses = {}
    for name, engine in (("fp32", ref), (args.scheme, quant)):
        t0 = time.perf_counter()
        responses[name] = engine.score_batch(requests)
        for r in responses[name]:
            if isinstance(r, Exception):
                raise r
        seconds[name] = round(time.perf_counter() - t0, 2)

    dp, dlp, dfloor, top1 = [], [], [], []
    for a, b in zip(responses[args.scheme], responses["fp32"], strict=True):
        for qa, qb in zip(a.results[0].queries, b.results[0].queries, strict=True):
            for ca, cb in zip(qa.combinations, qb.combinations, strict=True):
                pa, pb = [o.p for o in ca.options], [o.p for o in cb.options]
                dp += [abs(x - y) for x, y in zip(pa, pb, strict=True)]
                dlp += [abs(x.logprob - y.logprob) for x, y in zip(ca.options, cb.options, strict=True)]
                dfloor += [abs(x.floor_p - y.floor_p) for x, y in zip(ca.options, cb.options, strict=True)]
                top1.append(pa.index(max(pa)) == pb.index(max(pb)))

    commit = subprocess.run("git rev-parse --short HEAD", shell=True, capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    result = {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "model": ckpt.name,
        "scheme": args.scheme,
        "reference": "fp32",
        **({"fp8_scales": Path(args.fp8_scales).name} if args.fp8_scales else {}),
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "job": {"documents": len(docs), "doc_tokens": DOC_TOKENS,
                "questions": len(block["queries"]), "source": "news_articles.jsonl",
                "case_insensitive": args.case_insensitive},
        "pairs": len(top1),
        "p_abs_diff_mean": round(sum(dp) / len(dp), 5),
        "p_abs_diff_max": round(max(dp), 5),
        "top1_agreement": round(sum(top1) / len(top1), 4),
        "top1_disagreements": len(top1) - sum(top1),
        "logprob_abs_diff_mean": round(sum(dlp) / len(dlp), 5),
        "logprob_abs_diff_max": round(max(dlp), 5),
        "floor_p_abs_diff_max": round(max(dfloor), 5),
        "seconds": seconds,
    }
    text = json.dumps(result, indent=2) + "\n"
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
