"""fp8 checkpoints as published (compressed-tensors) on the GPU (skipped without CUDA): served
as stored by the fp8-static / fp8 kernels, bit-identical to the same model's dequantised
weights quantised at load by the same scheme (power-of-two weight scales keep those weights
exact in bf16, so re-quantising them gives the stored codes back), and alone vs packed."""

from __future__ import annotations

import pytest
import torch

from ..test_batch_invariance import assert_invariant
from ..test_engine_parity import NEWS, QUERIES, score
from ..test_fp8_checkpoints import engine_scales, write_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("activations", ["static", "dynamic"])
@pytest.mark.parametrize(("family", "strategy"), [("gemma3", "channel"), ("llama", "tensor")])
def test_fp8_checkpoint_on_cuda(family, strategy, activations, tmp_path, tiny_tokenizer_dir):
    from spinf_worker.engine import Engine, EngineSettings
    from spinf_worker.quant.fp8_static import save_scales

    info = write_case(tmp_path, tiny_tokenizer_dir, family, strategy, activations, pow2=True)
    engine = Engine.load(str(info["ct_dir"]), device="cuda")
    assert engine.scheme == ("fp8-static" if activations == "static" else "fp8")
    down = engine.model.layers[0].mlp.down_proj
    stored = info["layers"]["model.layers.0.mlp.down_proj"]
    assert torch.equal(down.weight.view(torch.uint8).cpu(), stored["weight"].view(torch.uint8))
    settings = EngineSettings(scheme="fp8")
    if activations == "static":
        save_scales(tmp_path / "scales.safetensors", engine_scales(info["layers"]), {})
        settings = EngineSettings(scheme="fp8-static",
                                  fp8_scales=str(tmp_path / "scales.safetensors"))
    dense = Engine.load(str(info["dense_dir"]), device="cuda", settings=settings)
    assert torch.equal(dense.model.layers[0].mlp.down_proj.weight.view(torch.uint8),
                       down.weight.view(torch.uint8))
    for a, b in zip(score(engine, NEWS, QUERIES), score(dense, NEWS, QUERIES), strict=True):
        assert a.model_dump() == b.model_dump()
    assert_invariant(engine, {"text": NEWS * 2, "scoring": {"queries": QUERIES}}, seed=5)
