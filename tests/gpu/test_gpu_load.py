"""Loading a model in its serving scheme (GPU): each weight is materialised once, in the
serving dtype, and the body's linear layers quantised as they load, so the load peaks near the
served size; the weights equal those of a full-precision build quantised afterwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

if torch.cuda.is_available():
    from spinf_worker.models.build import build_model, init_random
    from spinf_worker.models.layers import Linear
    from spinf_worker.models.loader import Checkpoint
    from spinf_worker.models.registry import family_for

# Gemma 3 with a wide body and a small vocabulary: the linear layers dominate the weights.
CONFIG = dict(model_type="gemma3_text", vocab_size=8192, hidden_size=2048,
              intermediate_size=8192, num_hidden_layers=12, num_attention_heads=8,
              num_key_value_heads=4, head_dim=256, sliding_window=512,
              query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
              max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=2, eos_token_id=1, pad_token_id=0)


def _checkpoint(weights: dict | None) -> Checkpoint:
    return Checkpoint(name="random", config=CONFIG, weights=weights, tokenizer=None,
                      bos_token_id=2, eos_token_id=1, chat_template=None,
                      weights_digest="random", path=Path("."))


def _bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *(m.weight_scale for m in model.modules()
                                      if isinstance(m, Linear) and m.weight_scale is not None)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _largest_linear(model: torch.nn.Module) -> int:
    return max(m.weight.numel() for m in model.modules() if isinstance(m, Linear))


@pytest.mark.parametrize("scheme", ["fp8", "int8", "bf16"])
def test_loading_peaks_near_the_served_size(scheme):
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    built = build_model(_checkpoint(None), "cuda", scheme)
    peak = torch.cuda.max_memory_allocated() - base
    served = _bytes(built.model)
    # beyond the served weights: one layer's bf16 weight and its fp32 copy while it is
    # quantised (2 + 4 bytes per weight, and the quantised copy), and the allocator's rounding
    assert peak <= served + 7 * _largest_linear(built.model) + (64 << 20), (peak, served)
    full_bf16 = sum(p.numel() * 2 for p in built.model.parameters())
    if scheme != "bf16":
        assert peak < 0.75 * full_bf16


@pytest.mark.parametrize("scheme", ["fp8", "int8"])
def test_quantised_while_loading_equals_quantised_after(scheme):
    """A checkpoint's weights loaded module by module and quantised at once are the weights
    of the whole model loaded in bf16 and quantised afterwards, bit for bit."""
    family = family_for(CONFIG)
    with torch.device("meta"):
        model = family.build(family.config(CONFIG))
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        init_random(model, seed=3)
    weights = {name: t.float().cpu() for name, t in model.state_dict().items()}
    with torch.no_grad():
        model.to_fp8() if scheme == "fp8" else model.to_int8()
    built = build_model(_checkpoint(weights), "cuda", scheme).model
    want, got = model.state_dict(), built.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name].view(torch.uint8), got[name].view(torch.uint8)), name
    for a, b in zip(model.modules(), built.modules(), strict=True):
        if isinstance(a, Linear) and a.weight_scale is not None:
            assert torch.equal(a.weight_scale, b.weight_scale)
