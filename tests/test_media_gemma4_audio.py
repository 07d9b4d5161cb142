"""Audio read by the Gemma 4 multimodal stack (CPU), against transformers'
Gemma4ForConditionalGeneration and its Gemma4AudioFeatureExtractor on a tiny random
checkpoint: WAV decoded with the standard library, the same log-mel features, the same
audio tokens and logprobs (|Δ| <= 1e-4), the audio in the document's root read once."""

from __future__ import annotations

import base64
import io
import wave

import numpy as np
import pytest
import torch

from . import media_oracle
from .conftest import TINY_BOS, TINY_GEMMA4_AUDIO_TOKENS, TINY_GEMMA4_IMAGE_TOKENS
from .media_builders import assert_packed_equals_alone, image_and_audio_request
from .test_media_gemma3 import QUERIES, option_logprobs
from .test_media_gemma4 import oracle_inputs
from .test_media_requests import image_part, image_url, worker_and_api_codes


def tone(seed: int, seconds: float, rate: int = 16_000) -> np.ndarray:
    """int16 samples: a few tones and some noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    x = sum(rng.uniform(0.1, 0.3) * np.sin(2 * np.pi * rng.uniform(80, 3000) * t)
            for _ in range(3)) + 0.05 * rng.standard_normal(t.shape[0])
    return np.clip(x * 32767, -32768, 32767).astype("<i2")


def wav_b64(samples: np.ndarray, rate: int = 16_000, channels: int = 1) -> str:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


def audio_part(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def audio_request(data: str, before: str = "Voice message:", after: str = " Thanks.",
                  queries=None) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": before}, audio_part(data), {"type": "text", "text": after}]}],
        "scoring": {"queries": queries or QUERIES, "case_insensitive": False}}


def oracle_audio(samples: list[np.ndarray]) -> dict:
    from transformers.models.gemma4.feature_extraction_gemma4 import (
        Gemma4AudioFeatureExtractor,
    )

    waves = [s.astype(np.float32) / 32768.0 for s in samples]
    return Gemma4AudioFeatureExtractor()(waves, return_tensors="pt")


def test_features_and_token_counts_equal_transformers(tiny_gemma4_vision_engine):
    processing = tiny_gemma4_vision_engine.preparer.media.audio
    for seconds in (0.05, 0.5, 1.234, 2.0):
        samples = tone(1, seconds)
        ours = processing.features(processing.waveform(wav_b64(samples), "wav"))
        theirs = oracle_audio([samples])
        assert torch.equal(ours[0], theirs["input_features"][0])
        assert torch.equal(ours[1], theirs["input_features_mask"][0])
        assert processing.header_samples(wav_b64(samples), "wav") == samples.shape[0]
        mask = theirs["input_features_mask"][0]
        for _ in range(2):
            mask = mask[::2][:(len(mask) + 2 - 3) // 2 + 1]
        assert processing.tokens(samples.shape[0]) == int(mask.sum())


def assert_audio_features_equal(engine, oracle) -> None:
    """A CPU engine's audio soft tokens equal transformers' (the media oracle's) within 1e-5."""
    for seconds in (0.3, 1.7):
        samples = tone(2, seconds)
        theirs_in = oracle_audio([samples])
        with torch.no_grad():
            out = oracle.model.get_audio_features(theirs_in["input_features"],
                                                  theirs_in["input_features_mask"])
            theirs = out.pooler_output[0][out.attention_mask[0]]
            feats, mask, _ = engine.preparer.media.audio.features(samples / 32768.0)
            ours = engine.model.audio_features(feats, mask)
        assert ours.shape == theirs.shape
        assert (ours - theirs).abs().max().item() <= 1e-5


def test_audio_features_equal_transformers(tiny_gemma4_vision_engine, tiny_gemma4_vision_oracle):
    assert_audio_features_equal(tiny_gemma4_vision_engine, tiny_gemma4_vision_oracle)


def oracle_scores(oracle, engine, samples: list[np.ndarray], images: list[str], text: str,
                  queries) -> dict[tuple, float]:
    """transformers given the extractor's features (and the images' patches): BOS + the text
    with each ``<|audio>`` expanded to the processor's audio sequence (and each ``<|image>``
    to its), the template, the option."""
    tok = engine.checkpoint.tokenizer
    boa, eoa, asoft = TINY_GEMMA4_AUDIO_TOKENS
    boi, eoi, isoft = TINY_GEMMA4_IMAGE_TOKENS
    audio = oracle_audio(samples)
    pieces = text.split(boa)
    counts = []
    for mask in audio["input_features_mask"]:
        for _ in range(2):
            mask = mask[::2][:(len(mask) + 2 - 3) // 2 + 1]
        counts.append(int(mask.sum()))
    text = pieces[0] + "".join(f"{boa}{asoft * n}{eoa}{piece}"
                               for n, piece in zip(counts, pieces[1:], strict=True))
    kwargs = {"input_features": audio["input_features"],
              "input_features_mask": audio["input_features_mask"]}
    if images:
        vision = oracle_inputs(images, engine.checkpoint.path)
        pieces = text.split(boi)
        text = pieces[0] + "".join(
            f"{boi}{isoft * int(n)}{eoi}{piece}"
            for n, piece in zip(vision["num_soft_tokens_per_image"], pieces[1:], strict=True))
        kwargs.update(pixel_values=vision["pixel_values"],
                      image_position_ids=vision["image_position_ids"])
    root = [TINY_BOS, *tok.encode(text, add_special_tokens=False).ids]
    return media_oracle.option_logprobs(
        oracle, tok, root, queries,
        media_oracle.marked("mm_token_type_ids", tok.token_to_id(isoft)), **kwargs)


@pytest.mark.parametrize("seconds", [0.4, 1.3])
def test_audio_and_text_score_like_transformers(tiny_gemma4_vision_engine,
                                                tiny_gemma4_vision_oracle, seconds):
    samples = tone(3, seconds)
    ours = option_logprobs(tiny_gemma4_vision_engine.score(audio_request(wav_b64(samples))))
    theirs = oracle_scores(tiny_gemma4_vision_oracle, tiny_gemma4_vision_engine, [samples], [],
                           f"Voice message:{TINY_GEMMA4_AUDIO_TOKENS[0]} Thanks.", QUERIES)
    assert ours.keys() == theirs.keys()
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst <= 1e-4, (worst, ours, theirs)


def test_an_image_and_an_audio_in_one_content(tiny_gemma4_vision_engine,
                                              tiny_gemma4_vision_oracle):
    samples, url = tone(4, 0.6), image_url(5, (40, 24))
    ours = option_logprobs(tiny_gemma4_vision_engine.score(
        image_and_audio_request(url, samples, QUERIES)))
    boi, boa = TINY_GEMMA4_IMAGE_TOKENS[0], TINY_GEMMA4_AUDIO_TOKENS[0]
    theirs = oracle_scores(tiny_gemma4_vision_oracle, tiny_gemma4_vision_engine, [samples],
                           [url], f"Listing:{boi} and the seller said{boa}", QUERIES)
    assert max(abs(ours[k] - theirs[k]) for k in ours) <= 1e-4


def test_the_audio_changes_the_scores_and_usage_counts_it(tiny_gemma4_vision_engine):
    engine = tiny_gemma4_vision_engine
    first = engine.score(audio_request(wav_b64(tone(6, 1.0))))
    second = engine.score(audio_request(wav_b64(tone(7, 1.0))))
    assert option_logprobs(first) != option_logprobs(second)
    tokens = engine.preparer.media.audio.tokens(16_000) + 2
    usage = first.usage
    assert usage.content["audio_tokens"] == tokens
    assert usage.content["audio_seconds"] == pytest.approx(1.0)
    assert usage.prompt_tokens_details["audio_tokens"] == tokens
    assert usage.content["text_tokens"] == usage.content["tokens"] - tokens


def test_other_rates_and_stereo_are_resampled_to_the_extractors_rate(tiny_gemma4_vision_engine):
    """8 kHz stereo reads as 16 kHz mono: the token count of its length at 16 kHz, and scores
    close to the same sound sent at 16 kHz (band-limited resampling of a low tone)."""
    processing = tiny_gemma4_vision_engine.preparer.media.audio
    rate, seconds = 8000, 0.9
    t = np.arange(int(rate * seconds)) / rate
    low = (0.3 * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    stereo = np.stack([low, low], axis=1).reshape(-1)
    data = wav_b64(stereo, rate=rate, channels=2)
    samples = processing.waveform(data, "wav")
    assert samples.shape[0] == processing.header_samples(data, "wav") == int(16_000 * seconds)
    t16 = np.arange(samples.shape[0]) / 16_000
    assert np.abs(samples - 0.3 * 32767 / 32768 * np.sin(2 * np.pi * 220 * t16)).max() < 1e-2
    response = tiny_gemma4_vision_engine.score(audio_request(data))
    assert response.usage.content["audio_tokens"] == processing.tokens(samples.shape[0]) + 2


@pytest.mark.parametrize(("part", "code"), [
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"ID3" + bytes(64))
                                             .decode(), "format": "mp3"}},
     "invalid_media"),                                       # no mp3 frame in it
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(
        b"RIFF\x24\x00\x00\x00WAVEfmt \x10\x00\x00\x00\x03\x00\x01\x00\x80\x3e\x00\x00"
        b"\x00\xfa\x00\x00\x04\x00\x20\x00data\x00\x00\x00\x00").decode(), "format": "wav"}},
     "invalid_media"),
    (audio_part(wav_b64(np.zeros(150, dtype="<i2"))), "invalid_media"),      # < 1 token
    (audio_part(base64.b64encode(base64.b64decode(wav_b64(tone(1, 0.5)))[:9001]).decode()),
     "invalid_media"),                                       # data cut short of its header
    (audio_part(wav_b64(np.zeros(1, dtype="<i2"))), "invalid_media"),
])
def test_audio_the_server_cannot_decode_is_a_400(tiny_gemma4_vision_engine, part, code):
    from spinf_worker.errors import InvalidRequestError

    request = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}],
               "scoring": {"queries": QUERIES}}
    result = tiny_gemma4_vision_engine.score_batch([request])[0]
    assert isinstance(result, InvalidRequestError), result
    assert (result.code, result.status) == (code, 400)
    assert result.param == "messages.0.content.1.input_audio.data"


def test_bit_identical_alone_and_packed_among_text_image_and_audio_documents(
        tiny_gemma4_vision_engine):
    import random

    from .test_media_gemma4 import other_requests

    rng = random.Random(8)

    def others(position: int) -> list[dict]:
        out = other_requests(rng, 7)
        out[1] = audio_request(wav_b64(tone(10 + position, rng.uniform(0.2, 1.5))))
        return out

    assert_packed_equals_alone(tiny_gemma4_vision_engine, audio_request(wav_b64(tone(9, 0.8))),
                               others, (0, 3, 7))


@pytest.mark.parametrize("parts", ["image", "audio", "both"])
def test_the_api_counts_gemma4_media_tokens_as_the_worker_does(tiny_gemma4_vision_engine,
                                                               parts):
    """With the served model's files (api/tokens.py), the API's checks count each image's and
    audio part's tokens (from their headers) in the processed tokens as the worker lays them
    out, and leave them out of the content limit: the same request passes or fails both
    alike."""
    from api.tokens import load

    engine = tiny_gemma4_vision_engine
    tokens = load(str(engine.checkpoint.path))
    assert tokens.image is not None and tokens.image.marker == TINY_GEMMA4_IMAGE_TOKENS[0]
    content = [{"type": "text", "text": "Listing:"}]
    if parts in ("image", "both"):
        content.append(image_part(image_url(4, (60, 20))))
    content.append({"type": "text", "text": " the seller said"})
    if parts in ("audio", "both"):
        content.append(audio_part(wav_b64(tone(11, 0.7))))
    base = {"messages": [{"role": "user", "content": content}],
            "scoring": {"queries": QUERIES, "case_insensitive": False}}
    doc = engine.preparer.prepare_batch([base])[0].docs[0]
    rows = doc.flat.tokens

    def both(limits: dict) -> tuple:
        return worker_and_api_codes(engine, {**base, "limits": limits}, tokens)

    assert both({"max_processed_tokens": rows}) == (None, None)
    assert both({"max_processed_tokens": rows - 1}) == ("request_too_large",) * 2
    text = len(engine.presenter.root_ids_batch([doc.text_only])[0]) - 1
    assert text < doc.flat.root - 1 - 10
    assert both({"max_content_tokens": text}) == (None, None)
    assert both({"max_content_tokens": text - 1}) == ("content_too_long",) * 2
