"""GPTQ int4 kept packed (W4A16, kernels/int4_matmul.py) against bf16 and fp8 on the news job,
on one GPU: the Gemma-3-12B shape and a Qwen3-8B-shaped stack with random int4 codes (group
128; speed does not depend on the values), questions/s, weights' memory at load, bit identity
of a document alone vs packed.

    python benchmarks/int4_gpu.py --tokenizer DIR_WITH_tokenizer.json --data DIR --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from gpu_bench import GEMMA_12B, QWEN3_8B, ROOT, random_checkpoint, run_engine
from tokenizers import Tokenizer

from spinf_worker.tools.news_job import build_requests, load_docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--questions", type=Path, default=ROOT / "benchmarks" / "news_questions.json")
    parser.add_argument("--docs", type=int, default=24)
    parser.add_argument("--shapes", default="12b,qwen3_8b")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    requests = build_requests(load_docs(args.data, tokenizer, args.docs),
                              json.loads(args.questions.read_text()))
    row = {"date": time.strftime("%Y-%m-%d"), "commit": args.commit,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "docs": args.docs}
    shapes = {"12b": GEMMA_12B, "qwen3_8b": QWEN3_8B}
    for name in args.shapes.split(","):
        ckpt = random_checkpoint(shapes[name], tokenizer)
        for scheme in ("int4", "bf16", "fp8"):
            figures, _ = run_engine(name, ckpt, scheme, requests)
            row.update(figures)
            print(json.dumps(figures), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{row['date']}-int4-gpu-{args.commit}.json"
    path.write_text(json.dumps(row, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
