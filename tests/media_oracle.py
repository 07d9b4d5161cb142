"""What transformers gives each option of a media request (the oracle of the media tests):
one plain forward over BOS + the expanded content, the template and the option, media tokens
marked by type; the options of one token after the same template share the forward of the
template (their logprobs are one row of it)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def option_logprobs(oracle, tokenizer, root: list[int], queries: list[dict],
                    token_types: Callable[[list[int]], dict[str, torch.Tensor]],
                    **inputs) -> dict[tuple[str, str], float]:
    """Each option's summed logprob. ``token_types(ids)``: the model's type-ids argument for
    the sequence (``mm_token_type_ids`` or ``token_type_ids``); ``inputs``: its media
    tensors."""
    def read(ids: list[int], start: int) -> torch.Tensor:
        """log-softmax at the rows that predict ids[start:] and the one after (logits only
        there: the full-vocabulary head over every row is most of a forward's time)."""
        with torch.no_grad():
            logits = oracle(input_ids=torch.tensor([ids]), **token_types(ids), **inputs,
                            logits_to_keep=len(ids) - start + 1).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    out = {}
    for q in queries:
        context = root + encode(q["template"].split("{?}")[0])
        following = None    # the next-token row after the template, read once
        for option in q["options"]:
            ids = encode(option)
            if len(ids) == 1:
                if following is None:
                    following = read(context, len(context))[-1]
                out[(q["id"], option)] = following[ids[0]].item()
            else:
                rows = read(context + ids, len(context))
                out[(q["id"], option)] = sum(rows[k, t].item() for k, t in enumerate(ids))
    return out


def marked(name: str, token: int, value: int = 1) -> Callable[[list[int]], dict]:
    """``token_types`` marking ``token``'s places with ``value`` in the argument ``name``."""
    return lambda ids: {name: torch.tensor([[value * int(i == token) for i in ids]])}
