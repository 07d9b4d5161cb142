"""The fp8 scheme on the multimodal Gemma 4 (CPU, its exact reference path): it rounds the
text body's linear layers and their inputs, per output channel and per token (quant/fp8.py),
and nothing of the towers or the embedders; transformers holding those weights and rounding
those inputs alike (media_oracle.served_weights) gives the same logprobs, for an audio, an
image with an audio and a text-only document. The GPU test's fp8 oracle describes the same
layers (tests/gpu/test_gpu_media.py). On its tamed checkpoint, as there: on the untamed one's
nearly one-hot attention, the two sides' 1e-5 apart in fp32 flip a rounding of some input
(0.09 apart with an image and an audio)."""

from __future__ import annotations

import pytest
import torch

from . import media_oracle
from .conftest import (
    TINY_BOS,
    TINY_GEMMA4_AUDIO_TOKENS,
    TINY_GEMMA4_IMAGE_TOKENS,
    tamed,
    write_tiny_gemma4_vision,
)
from .media_builders import image_and_audio_request
from .test_media_gemma3 import QUERIES, option_logprobs
from .test_media_gemma4_audio import audio_request, tone, wav_b64
from .test_media_gemma4_audio import oracle_scores as audio_oracle
from .test_media_requests import image_url

TEXT = "Voice message: Thanks."


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory, tiny_tokenizer_dir):
    return tamed(write_tiny_gemma4_vision(tmp_path_factory.mktemp("tamed-gemma4"),
                                          tiny_tokenizer_dir))


@pytest.fixture(scope="module")
def fp8_engine(gemma4_dir):
    from spinf_worker.engine import Engine
    from spinf_worker.engine.engine import EngineSettings

    return Engine.load(str(gemma4_dir), device="cpu", settings=EngineSettings(scheme="fp8"))


@pytest.fixture(scope="module")
def oracle(gemma4_dir):
    return media_oracle.gemma4_oracle(gemma4_dir)


def test_fp8_rounds_the_layers_the_oracle_rounds(fp8_engine, oracle):
    """The engine's fp8 layers are transformers' text linear layers, by name; every tower's
    and embedder's linear layer stays dense."""
    from spinf_worker.models.layers import Linear

    model = fp8_engine.model
    fp8 = {n for n, m in model.named_modules()
           if isinstance(m, Linear) and m.weight.dtype == torch.float8_e4m3fn}
    text = {n for n, m in oracle.model.language_model.named_modules()
            if isinstance(m, torch.nn.Linear)}
    assert fp8 == text and "per_layer_model_projection" in fp8
    media = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
    assert all(m.weight.dtype == torch.float32 for name in media
               for m in getattr(model, name).modules() if isinstance(m, Linear))


def text_oracle(oracle, engine, text: str) -> dict[tuple, float]:
    tok = engine.checkpoint.tokenizer
    root = [TINY_BOS, *tok.encode(text, add_special_tokens=False).ids]
    soft = tok.token_to_id(TINY_GEMMA4_IMAGE_TOKENS[2])
    return media_oracle.option_logprobs(oracle, tok, root, QUERIES,
                                        media_oracle.marked("mm_token_type_ids", soft))


@pytest.mark.parametrize("document", ["audio", "image and audio", "text"])
def test_fp8_scores_like_transformers_rounding_the_same(fp8_engine, oracle, document):
    """Within 1e-4 of transformers holding the served weights and rounding the same inputs;
    the weights alone leave the activations' rounding, over 0.1 here (up to 1.8 on this
    checkpoint, text-only documents as much as media: tests/gpu/test_gpu_media.py)."""
    engine = fp8_engine
    boi, boa = TINY_GEMMA4_IMAGE_TOKENS[0], TINY_GEMMA4_AUDIO_TOKENS[0]
    if document == "audio":
        samples = tone(3, 1.3)
        ours = option_logprobs(engine.score(audio_request(wav_b64(samples))))
        read = lambda model: audio_oracle(  # noqa: E731
            model, engine, [samples], [], f"Voice message:{boa} Thanks.", QUERIES)
    elif document == "image and audio":
        samples, url = tone(4, 0.6), image_url(5, (40, 24))
        ours = option_logprobs(engine.score(image_and_audio_request(url, samples, QUERIES)))
        read = lambda model: audio_oracle(  # noqa: E731
            model, engine, [samples], [url], f"Listing:{boi} and the seller said{boa}", QUERIES)
    else:
        ours = option_logprobs(engine.score({
            "messages": [{"role": "user", "content": [{"type": "text", "text": TEXT}]}],
            "scoring": {"queries": QUERIES, "case_insensitive": False}}))
        read = lambda model: text_oracle(model, engine, TEXT)  # noqa: E731
    theirs = read(media_oracle.served_weights(oracle, "fp8", torch.float32, activations=True))
    assert ours.keys() == theirs.keys()
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst <= 1e-4, (worst, ours, theirs)
    unrounded = read(media_oracle.served_weights(oracle, "fp8", torch.float32))
    assert max(abs(ours[k] - unrounded[k]) for k in ours) > 0.1
