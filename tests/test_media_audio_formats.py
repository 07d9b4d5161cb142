"""Audio in every hosted format (wav, mp3, flac, ogg, m4a, webm) read by the Gemma 4 stack:
tones made here and encoded with PyAV, decoded as transformers' load_audio decodes them
(libsndfile + soxr, where libsndfile reads the format: bit for bit for WAV and FLAC, within
a decoder's rounding for mp3), the others against the WAV of the same samples within a lossy
codec's error; each scores like transformers given the same samples (|Δ| <= 1e-4); bad data
is invalid_media naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from .conftest import TINY_GEMMA4_AUDIO_TOKENS
from .test_media_gemma3 import QUERIES, option_logprobs
from .test_media_gemma4_audio import oracle_scores

# format -> (PyAV muxer, encoder, the rate the encoder takes)
ENCODERS = {"wav": ("wav", "pcm_s16le", None), "mp3": ("mp3", "libmp3lame", None),
            "flac": ("flac", "flac", None), "ogg": ("ogg", "libopus", 48_000),
            "m4a": ("ipod", "aac", None), "webm": ("webm", "libopus", 48_000)}


def tones(rate: int, seconds: float, channels: int = 1, seed: int = 0) -> np.ndarray:
    """int16 [n, channels]: two tones per channel."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(rate * seconds)) / rate
    x = np.stack([0.3 * np.sin(2 * np.pi * rng.uniform(200, 900) * t)
                  + 0.1 * np.sin(2 * np.pi * rng.uniform(1000, 3000) * t)
                  for _ in range(channels)], axis=1)
    return np.round(x * 32767).astype(np.int16)


def encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    """int16 [n, channels] -> the bytes of a ``fmt`` file (PyAV)."""
    import av

    muxer, codec, _ = ENCODERS[fmt]
    buffer = io.BytesIO()
    layout = "mono" if samples.shape[1] == 1 else "stereo"
    with av.open(buffer, "w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def part(data: str, fmt: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


def request(data: str, fmt: str) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Voice message:"}, part(data, fmt),
        {"type": "text", "text": " Thanks."}]}],
        "scoring": {"queries": QUERIES, "case_insensitive": False}}


def transformers_decoding(data: str) -> np.ndarray:
    from transformers.audio_utils import load_audio

    return load_audio(data, sampling_rate=16_000, backend="soundfile")


@pytest.mark.parametrize(("fmt", "rate", "channels"), [
    ("wav", 16_000, 1), ("wav", 22_050, 2), ("flac", 16_000, 1), ("flac", 44_100, 2),
    ("mp3", 16_000, 1), ("mp3", 44_100, 2)])
def test_decoding_equals_transformers_load_audio(tiny_gemma4_vision_engine, fmt, rate,
                                                 channels):
    """What libsndfile reads, bit for bit (mp3: two decoders, within 1e-5); the same
    resampling (soxr, its length); the same features; the length the token count reads."""
    processing = tiny_gemma4_vision_engine.preparer.media.audio
    data = b64(encode(tones(rate, 1.1, channels), rate, fmt))
    ours, theirs = processing.waveform(data, fmt), transformers_decoding(data)
    assert ours.dtype == theirs.dtype == np.float32 and ours.shape == theirs.shape
    assert processing.header_samples(data, fmt) == ours.shape[0]
    features = [processing.features(x)[0] for x in (ours, theirs)]
    if fmt == "mp3":
        assert np.abs(ours - theirs).max() <= 1e-5
        assert (features[0] - features[1]).abs().max() <= 1e-2
    else:
        assert np.array_equal(ours, theirs)
        assert torch.equal(*features)


@pytest.mark.parametrize(("fmt", "channels"), [("flac", 1), ("mp3", 1), ("ogg", 1),
                                               ("m4a", 1), ("webm", 2)])
def test_lossy_and_lossless_formats_read_as_their_wav(tiny_gemma4_vision_engine, fmt,
                                                      channels):
    """The same samples as a WAV and as ``fmt``: FLAC decodes to the WAV's exact samples; a
    lossy codec within its error (AAC in these MP4 files keeps its encoder's priming frame:
    aligned first)."""
    processing = tiny_gemma4_vision_engine.preparer.media.audio
    rate = ENCODERS[fmt][2] or 16_000
    samples = tones(rate, 1.0, channels, seed=3)
    samples[:rate // 10] = 0            # an onset: the alignment below finds it
    wav = processing.waveform(b64(encode(samples, rate, "wav")), "wav")
    got = processing.waveform(b64(encode(samples, rate, fmt)), fmt)
    if fmt == "flac":
        assert np.array_equal(got, wav)
        return
    if fmt == "m4a":
        lag = min(range(2048), key=lambda k: float(np.sum((got[k:k + 4000] - wav[:4000]) ** 2)))
        got = got[lag:]
    n = min(got.shape[0], wav.shape[0])
    assert n >= wav.shape[0] - 64
    error = got[:n] - wav[:n]
    assert np.sqrt(np.mean(error ** 2)) <= 0.02 * np.sqrt(np.mean(wav ** 2)) + 0.01


@pytest.mark.parametrize("fmt", ["mp3", "flac", "ogg", "m4a", "webm"])
def test_every_format_scores(tiny_gemma4_vision_engine, fmt):
    engine = tiny_gemma4_vision_engine
    processing = engine.preparer.media.audio
    rate = ENCODERS[fmt][2] or 16_000
    data = b64(encode(tones(rate, 0.7, seed=5), rate, fmt))
    response = engine.score(request(data, fmt))
    tokens = processing.tokens(processing.header_samples(data, fmt))
    assert response.usage.content["audio_tokens"] == tokens + 2
    assert response.usage.content["audio_seconds"] == pytest.approx(
        processing.header_samples(data, fmt) / 16_000)
    assert len(option_logprobs(response)) == sum(len(q["options"]) for q in QUERIES)


@pytest.mark.parametrize("fmt", ["flac", "mp3", "webm"])
def test_scores_like_transformers(tiny_gemma4_vision_engine, tiny_gemma4_vision_oracle, fmt):
    """Given the same samples, |Δ| <= 1e-4: a FLAC's as transformers decodes it (the same
    samples bit for bit); an mp3's and a webm's as decoded here (libsndfile reads no webm,
    and its mp3 decoder rounds otherwise: an mp3 then scores within 2e-3 of ours)."""
    engine = tiny_gemma4_vision_engine
    rate = ENCODERS[fmt][2] or 44_100
    data = b64(encode(tones(rate, 0.9, 2, seed=7), rate, fmt))
    ours = option_logprobs(engine.score(request(data, fmt)))
    text = f"Voice message:{TINY_GEMMA4_AUDIO_TOKENS[0]} Thanks."

    def oracle(waveform: np.ndarray) -> dict:
        # oracle_scores reads int16-scaled samples: scaling by 2**15 is exact in float32
        return oracle_scores(tiny_gemma4_vision_oracle, engine, [waveform * np.float32(32768)],
                             [], text, QUERIES)

    decoded = engine.preparer.media.audio.waveform(data, fmt)
    theirs = oracle(transformers_decoding(data) if fmt == "flac" else decoded)
    assert max(abs(ours[k] - theirs[k]) for k in ours) <= 1e-4
    if fmt == "mp3":
        theirs = oracle(transformers_decoding(data))
        assert max(abs(ours[k] - theirs[k]) for k in ours) <= 2e-3


def bad_parts() -> list[tuple[dict, dict | None]]:
    """(part, limits): data no decoder reads, a format other than the one declared, a part
    over the call's seconds."""
    flac = b64(encode(tones(16_000, 0.5), 16_000, "flac"))
    long_mp3 = b64(encode(tones(8_000, 3.0), 8_000, "mp3"))
    out = [(part(b64(b"\x00\x01garbage" * 40), fmt), None)
           for fmt in ("mp3", "flac", "ogg", "m4a", "webm")]
    return out + [(part(flac, "mp3"), None), (part(flac, "m4a"), None),
                  (part(long_mp3, "mp3"), {"max_audio_seconds": 2})]


def test_bad_audio_is_invalid_media_at_the_worker_and_in_the_apis_checks(
        tiny_gemma4_vision_engine):
    from spinf_worker.errors import InvalidRequestError
    from spinf_worker.protocol import ScoreRequest
    from spinf_worker.request_limits import check_request

    for bad, limits in bad_parts():
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                          bad]}],
                "scoring": {"queries": QUERIES}, **({"limits": limits} if limits else {})}
        worker = tiny_gemma4_vision_engine.score_batch([body])[0]
        with pytest.raises(InvalidRequestError) as api:
            check_request(ScoreRequest.parse(body), {}, tokens=None)
        for error in (worker, api.value):
            assert isinstance(error, InvalidRequestError), error
            assert (error.code, error.status, error.param) == (
                "invalid_media", 400, "messages.0.content.1.input_audio.data"), error.message
