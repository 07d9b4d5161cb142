"""The vision and audio towers read a pass's media in one run (models/media_rows.py), and an
image's or an audio's soft tokens, and so every score, are bit-identical whether it is read
alone or beside 1-4 other media of other sizes, wherever it stands among them."""

from __future__ import annotations

import pytest
import torch

from spinf_worker.models import media_rows

from .test_media_gemma3 import QUERIES, media_request, scores_and_residuals
from .test_media_gemma4_audio import audio_request, tone, wav_b64
from .test_media_requests import image_url

COUNTS = (1, 2, 3, 5)
SIZES = [(45, 30), (20, 64), (9, 9), (120, 120), (300, 9)]     # other patch counts (Gemma 4)
SECONDS = [0.8, 0.2, 1.5, 0.05, 2.3]


def engine_for(request, family: str):
    return request.getfixturevalue(
        "tiny_vision_engine" if family == "gemma3" else "tiny_gemma4_vision_engine")


def payloads(engine, family: str) -> tuple[list, object]:
    """Five media of mixed sizes as the runner hands them to the model, and its batched
    encoder."""
    media = engine.preparer.media
    if family == "audio":
        audio = [media.audio.features(tone(20 + i, s) / 32768.0)[:2]
                 for i, s in enumerate(SECONDS)]
        return audio, engine.model.encode_audio
    images = [media.processing.pixels(image_url(30 + i, size), 10**8)
              for i, size in enumerate(SIZES)]
    return images, engine.model.encode_images


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "audio"])
def test_soft_tokens_bit_identical_alone_and_in_one_tower_run(request, family, monkeypatch):
    engine = engine_for(request, family)
    media, encode = payloads(engine, family)
    with torch.inference_mode():
        alone = [encode([m])[0] for m in media]
        assert len({a.shape[0] for a in alone}) > (family != "gemma3")   # mixed token counts
        for count in COUNTS:
            for shift in range(count):       # every medium at every place among its peers
                order = [(shift + j) % len(media) for j in range(count)]
                out = encode([media[i] for i in order])
                assert len(out) == count
                for i, o in zip(order, out, strict=True):
                    assert torch.equal(o, alone[i]), (count, shift, i)
        # split into several runs by the rows bound: the same bits
        monkeypatch.setattr(media_rows, "TOWER_ROWS", 256)
        out = encode(media)
        assert all(torch.equal(o, a) for o, a in zip(out, alone, strict=True))


def media_requests(family: str) -> list[dict]:
    if family == "audio":
        return [audio_request(wav_b64(tone(40 + i, s))) for i, s in enumerate(SECONDS)]
    queries = [QUERIES[1]]
    return [media_request(image_url(50 + i, size), before=f"Photo {i}:" * (i + 1),
                          queries=queries if i % 2 else None)
            for i, size in enumerate(SIZES)]


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "audio"])
def test_scores_bit_identical_alone_and_in_a_pass_of_several_media(request, family,
                                                                   monkeypatch):
    """One pass of 1, 2, 3 or 5 media documents: the tower runs once over all of them, and
    each document scores as it does alone."""
    engine = engine_for(request, family)
    requests = media_requests(family)
    alone = [scores_and_residuals(engine.score(r)) for r in requests]
    runs = []
    name = "encode_audio" if family == "audio" else "encode_images"
    encode = getattr(engine.model, name)
    monkeypatch.setattr(engine.model, name,
                        lambda media: (runs.append(len(media)) if media else None)
                        or encode(media))
    monkeypatch.setattr(engine.settings, "max_pass_tokens", 1 << 20)   # one pass
    for count in COUNTS:
        for shift in (0, count - 1):
            order = [(shift + j) % len(requests) for j in range(count)]
            runs.clear()
            packed = engine.score_batch([requests[i] for i in order])
            assert runs == [count], runs
            for i, response in zip(order, packed, strict=True):
                assert scores_and_residuals(response) == alone[i], (count, shift, i)


def wide_tower(family: str):
    """A random tower of a real one's proportions (64-wide heads, grouped keys, audio with
    padding frames), wider than the tiny checkpoints' 24, and five media of mixed sizes."""
    from spinf_worker.models.gemma3_vision import SiglipConfig, SiglipVisionTower
    from spinf_worker.models.gemma4_audio import Gemma4AudioTower, Gemma4AudioTowerConfig
    from spinf_worker.models.gemma4_vision import Gemma4VisionTower, Gemma4VisionTowerConfig

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if family == "gemma3":
        tower = SiglipVisionTower(SiglipConfig(hidden_size=256, intermediate_size=1024,
                                               num_layers=2, num_heads=4, image_size=96,
                                               patch_size=8))
        media = [torch.randn(3, 96, 96, generator=g) for _ in range(5)]
    elif family == "gemma4":
        tower = Gemma4VisionTower(Gemma4VisionTowerConfig(
            hidden_size=256, intermediate_size=1024, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=64, patch_size=4, position_embedding_size=64))
        media = [torch.rand(3 * h, 3 * w, 48, generator=g)
                 for h, w in ((4, 5), (9, 2), (1, 1), (12, 12), (3, 14))]
    else:
        tower = Gemma4AudioTower(Gemma4AudioTowerConfig(
            hidden_size=256, num_layers=2, num_heads=4, use_clipped_linears=False,
            output_proj_dims=384))
        media = []
        for frames in (80, 20, 150, 7, 230):
            mask = torch.ones(frames, dtype=torch.bool)
            mask[frames - frames // 5:] = False
            media.append((torch.randn(frames, 128, generator=g) * mask[:, None], mask))
    for p in tower.parameters():
        p.data.normal_(0, 0.1, generator=g)
    return tower, media


@pytest.mark.parametrize("family", ["gemma3", "gemma4", "audio"])
def test_wide_towers_are_batch_invariant(family):
    tower, media = wide_tower(family)
    with torch.inference_mode():
        alone = [tower([m])[0] for m in media]
        for count in COUNTS:
            order = [(count + j) % len(media) for j in range(count)]
            out = tower([media[i] for i in order])
            for i, o in zip(order, out, strict=True):
                assert torch.equal(o, alone[i]), (count, i)


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_fp8_leaves_the_towers_and_projectors_in_the_engines_dtype(request, family):
    """fp8 is the text stack's scheme: the linear layers it converts are the body's but the
    media modules' (towers, projector, embedders), which keep the engine's dtype on CUDA."""
    from spinf_worker.models.layers import Linear

    model = engine_for(request, family).model
    media = {m for name in model.MEDIA_MODULES if getattr(model, name, None) is not None
             for m in getattr(model, name).modules() if isinstance(m, Linear)}
    assert media and len(model.MEDIA_MODULES) == (2 if family == "gemma3" else 4)
    kept = set(model.fp8_linears())
    assert kept == set(model.body_linears()) - media
    assert all(m in kept for m in model.layers.modules() if isinstance(m, Linear))
