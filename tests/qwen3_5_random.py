"""The random Qwen3.5 of the GPU test (tests/gpu/test_gpu_qwen3_5.py), built on the CPU in fp32
(the CPU measurements of its setup: benchmarks/qwen3_5_fp8_rounding.py)."""

from __future__ import annotations

import torch

from spinf_worker.models.build import init_random
from spinf_worker.models.layers import Linear
from spinf_worker.models.qwen3_5 import GatedRMSNorm, Qwen3_5Config, Qwen3_5Model

# the released 27B's proportions, narrower: 3 DeltaNet layers to 1 full, 16 q/k heads serving
# 48 value heads there (here 2 -> 6), head dims 128 (DeltaNet) and 256 (attention)
CFG = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=8, num_heads=4,
           num_kv_heads=2, head_dim=256, rotary_dim=64,
           layer_types=("linear_attention",) * 3 + ("full_attention",) + (
               "linear_attention",) * 3 + ("full_attention",),
           linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=128,
           linear_value_head_dim=128, tie_word_embeddings=False)


def random_qwen3_5() -> Qwen3_5Model:
    """CFG's model on the CPU in fp32, the same weights every call."""
    with torch.device("meta"):
        model = Qwen3_5Model(Qwen3_5Config(**CFG))
    model = model.to_empty(device="cpu").float()
    with torch.no_grad():
        init_random(model, seed=0)
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):   # 1 + w norms near 1, the gated norm's w too
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            if name.endswith("A_log"):          # decays over a few to a few hundred tokens
                p.copy_(torch.linspace(-4.0, 0.5, p.numel()))
            if name.endswith("conv1d.weight"):
                p.normal_(0.0, 0.3, generator=gen)
        for m in model.modules():
            if isinstance(m, GatedRMSNorm):
                m.weight.fill_(1.0)
    return model.eval()


def body_linears(model: Qwen3_5Model) -> list[Linear]:
    """Every linear layer but the LM head: the DeltaNet layers' joined input projection
    (q|k|v|z|b|a) and output projection, attention's q|gate|k|v and output, the MLPs'."""
    return [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
