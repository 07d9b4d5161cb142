"""Random scoring documents (token ids only, no tokenizer) for passes of a random model: the
GPU tests' and the CPU measurements of their setups (benchmarks/qwen3_5_fp8_rounding.py)."""

from __future__ import annotations

import random

from spinf_worker.engine.layout import Branch, DocTree


def random_docs(n: int, seed: int) -> list:
    rng = random.Random(seed)

    # Questions from a few tokens, so their branches share prefixes in the tree.
    def doc() -> DocTree:
        return DocTree([2] + [rng.randrange(5, 4000) for _ in range(rng.randint(1, 300))],
                       [Branch([rng.choice((17, 18, 19)) for _ in range(rng.randint(0, 12))],
                               [[rng.randrange(5, 40) for _ in range(rng.randint(1, 3))]
                                for _ in range(rng.randint(1, 4))]) for _ in range(8)])
    return [doc().flatten(0) for _ in range(n)]
