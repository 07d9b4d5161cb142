"""What transformers gives each option of a media request (the oracle of the media tests):
one plain forward per (query, option) over BOS + the expanded content, the template and the
option, media tokens marked by type."""

from __future__ import annotations

from collections.abc import Callable

import torch


def option_logprobs(oracle, tokenizer, root: list[int], queries: list[dict],
                    token_types: Callable[[list[int]], dict[str, torch.Tensor]],
                    **inputs) -> dict[tuple[str, str], float]:
    """Each option's summed logprob. ``token_types(ids)``: the model's type-ids argument for
    the sequence (``mm_token_type_ids`` or ``token_type_ids``); ``inputs``: its media
    tensors."""
    out = {}
    for q in queries:
        prefix = tokenizer.encode(q["template"].split("{?}")[0], add_special_tokens=False).ids
        for option in q["options"]:
            ids = root + prefix + tokenizer.encode(option, add_special_tokens=False).ids
            with torch.no_grad():
                logits = oracle(input_ids=torch.tensor([ids]), **token_types(ids),
                                **inputs).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            start = len(root) + len(prefix)
            out[(q["id"], option)] = sum(logprobs[j - 1, ids[j]].item()
                                         for j in range(start, len(ids)))
    return out


def marked(name: str, token: int, value: int = 1) -> Callable[[list[int]], dict]:
    """``token_types`` marking ``token``'s places with ``value`` in the argument ``name``."""
    return lambda ids: {name: torch.tensor([[value * int(i == token) for i in ids]])}
