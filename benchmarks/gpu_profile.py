"""Where a pass's time goes on the GPU: torch.profiler over one score_batch of the news job.

    python benchmarks/gpu_profile.py --tokenizer DIR --data DIR [--model 12b|270m] [--scheme bf16|fp8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import GEMMA_12B, GEMMA_270M, ROOT, load_docs  # noqa: E402

from spinf_worker.engine import Engine, EngineSettings  # noqa: E402
from spinf_worker.models.loader import Checkpoint  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", default="12b")
    parser.add_argument("--scheme", default="bf16")
    parser.add_argument("--rows", type=int, default=30)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    questions = json.loads((ROOT / "benchmarks" / "news_questions.json").read_text())
    requests = [{"text": d, "scoring": questions} for d in load_docs(args.data, tokenizer, 24, 470)]
    cfg = GEMMA_12B if args.model == "12b" else GEMMA_270M
    ckpt = Checkpoint(name="random", config=cfg, weights=None, tokenizer=tokenizer,
                      bos_token_id=2, eos_token_id=1, chat_template=None,
                      weights_digest="random", path=Path("."))
    engine = Engine(ckpt, device="cuda", settings=EngineSettings(scheme=args.scheme))
    engine.score_batch(requests)
    engine.score_batch(requests)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.score_batch(requests)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
