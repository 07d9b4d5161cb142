"""What transformers gives each option of a media request (the oracle of the media tests):
one plain forward over BOS + the expanded content, the template and the option, media tokens
marked by type; the options of one token after the same template share the forward of the
template (their logprobs are one row of it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch


def gemma4_oracle(path: Path | str):
    """transformers' Gemma4ForConditionalGeneration in fp32 with eager attention, its audio
    tower through SDPA where the installed transformers offers it. transformers 5.17's eager
    audio attention hands its additive mask (0 / finfo.min) to
    ``masked_fill(mask.logical_not(), ...)``, which masks every key it should keep and keeps
    every key it should mask: its audio features are wrong (1.5 off on the tiny checkpoint),
    and every audio score with them, on whatever device the engine runs. Its SDPA path reads
    a boolean mask as meant; 5.25 reads the additive one right eagerly and refuses SDPA for
    the audio tower (then it stays eager)."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    tower = getattr(model.model, "audio_tower", None)
    if tower is not None:
        # no SDPA for the audio tower (ValueError): its eager path reads the mask right
        with contextlib.suppress(ValueError):
            tower.set_attn_implementation("sdpa")
    return model


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


def text_body_linears(model) -> list[torch.nn.Module]:
    """A multimodal model's text body's linear layers (Gemma 4's ``model.language_model``):
    what the fp8 scheme quantises there, the towers, the embedders and the LM head aside."""
    return [m for m in model.model.language_model.modules() if isinstance(m, torch.nn.Linear)]


def served_weights(oracle, scheme: str, dtype: torch.dtype = torch.bfloat16, *,
                   activations: bool = False,
                   linears: Callable[[torch.nn.Module], list] = text_body_linears):
    """A copy of the fp32 oracle holding the weights the engine serves under ``scheme``, still
    computing in fp32: rounded to ``dtype`` (the engine's: bf16 on CUDA, fp32 on the CPU;
    the fp32 scheme: as they are), and for fp8 ``linears(copy)``'s weights (by default the
    text body's linear layers) then by quant/fp8.py's per-channel rule (the towers and
    embedders stay in ``dtype``). On the tamed Gemma 4 checkpoint the weights' rounding alone
    is most of a bf16 pass's distance to fp32 (0.12 of 0.14 with an audio, on the CPU);
    against the served weights the CPU's bf16 module forward is within 0.05 on every Gemma 4
    media test, where a wrong audio rule moves options by 0.16.

    ``activations`` (fp8): those layers also round their inputs per token by quant/fp8.py's
    rule, as the fp8 scheme does: the whole of what it serves, which the CPU's fp8 path
    then equals (tests/test_media_gemma4_fp8.py, tests/test_qwen3_5_fp8.py). ``linears`` may
    name any modules with an ``[out, in]`` weight whose first argument is the input (the
    engine's own models/layers.Linear too)."""
    import copy

    if scheme == "fp32":
        return oracle
    served = copy.deepcopy(oracle)
    with torch.no_grad():
        for p in served.parameters():
            p.copy_(p.to(dtype).float())
        if scheme == "fp8":
            round_as_fp8(linears(served), activations=activations)
    return served.eval()


def round_as_fp8(linears, *, activations: bool = False) -> None:
    """In place, each module of ``linears`` holding its weight rounded by quant/fp8.py's
    per-channel rule (read back, still in the weight's dtype); ``activations``: rounding its
    input per token too (a forward pre-hook)."""
    from spinf_worker.quant.fp8 import quantize_weight

    def per_token(module, args):
        return (rounded_per_token(args[0]), *args[1:])

    with torch.no_grad():
        for m in linears:
            q, scale = quantize_weight(m.weight)
            m.weight.copy_(q.float() * scale[:, None])
            if activations:
                m.register_forward_pre_hook(per_token)


def rounded_per_token(x: torch.Tensor) -> torch.Tensor:
    """``x`` with each row quantised by quant/fp8.py's per-token rule and read back: what the
    fp8 scheme feeds its linear layers."""
    from spinf_worker.quant.fp8 import quantize_rows

    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale[:, None]).reshape(x.shape).to(x.dtype)
