"""Audio parts decoded (no torch): a WAV's length from its header and its PCM by the standard
library; mp3, flac, ogg, m4a and webm by PyAV (FFmpeg's demuxers and decoders). The demuxer
is the declared format's, never a probed one, so bytes of another kind are ``invalid_media``
and nothing but the part's own bytes is ever opened.

Those formats tell their length only when decoded: the API decodes a part (on a thread) to
check ``max_audio_seconds`` and count its tokens, the worker again to read it; decoding stops
past the limit. Samples become float32 as libsndfile reads them (integer PCM over
2**(bits-1)), channels averaged, and are resampled as transformers' ``load_audio`` does
(soxr at "soxr_hq", the result padded or cut to ceil(n * rate / source rate) samples).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from functools import lru_cache

from .media import MediaError, b64decode, resampled_length, wav_length

# the demuxer each hosted format is read with (FFmpeg's names)
DEMUXERS = {"mp3": "mp3", "flac": "flac", "ogg": "ogg", "m4a": "mp4", "webm": "webm"}


def _frames(data: bytes, fmt: str) -> Iterator:
    """The decoded frames of the first audio stream, all at one sample rate."""
    import av

    try:
        with av.open(io.BytesIO(data), format=DEMUXERS[fmt]) as container:
            if not container.streams.audio:
                raise MediaError(f"the {fmt} data holds no audio stream")
            stream, rate = container.streams.audio[0], None
            for packet in container.demux(stream):
                for frame in packet.decode():
                    if rate is not None and frame.sample_rate != rate:
                        raise MediaError("the audio changes its sample rate")
                    rate = frame.sample_rate
                    yield frame
    except (av.FFmpegError, ValueError, EOFError) as exc:
        raise MediaError(f"the {fmt} audio could not be decoded ({exc})") from None


def _decoded(data: bytes, fmt: str, max_seconds: float, arrays: bool):
    """(samples, rate, the frames as [channels, n] float32 arrays or None)."""
    samples, rate, parts = 0, 0, []
    for frame in _frames(data, fmt):
        samples, rate = samples + frame.samples, frame.sample_rate
        if samples > max_seconds * rate:
            raise MediaError(f"the audio is over {max_seconds:,} s; at most {max_seconds:,} s")
        if arrays:
            parts.append(_float_planes(frame))
    if not samples:
        raise MediaError(f"the {fmt} data holds no audio samples")
    return samples, rate, parts


@lru_cache(maxsize=16)
def audio_length(data: str, fmt: str, max_seconds: float) -> tuple[int, int]:
    """(sample frames, sample rate) of a base64 audio part: a WAV's from its header, the
    other formats' by decoding (cached: the API counts tokens after checking the limit, and
    the worker lays a part out before reading it). MediaError when it cannot be decoded."""
    raw = b64decode(data, "audio data")
    if fmt == "wav":
        return wav_length(raw)
    samples, rate, _ = _decoded(raw, fmt, max_seconds, arrays=False)
    return samples, rate


def decode_mono(data: str, fmt: str, max_seconds: float):
    """A base64 mp3 / flac / ogg / m4a / webm part -> (float32 mono samples, their rate)."""
    import numpy as np

    _, rate, parts = _decoded(b64decode(data, "audio data"), fmt, max_seconds, arrays=True)
    planes = np.concatenate(parts, axis=1)
    return (planes.mean(axis=0) if planes.shape[0] > 1 else planes[0]), rate


def _float_planes(frame):
    """One frame as [channels, samples] float32 in [-1, 1]."""
    import numpy as np

    x = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:
        x = x.reshape(-1, channels).T
    if x.dtype == np.uint8:
        x = (x.astype(np.float32) - 128.0) / 128.0
    elif x.dtype.kind == "i":
        x = (x.astype(np.float64) / float(2 ** (8 * x.dtype.itemsize - 1)))
    return np.ascontiguousarray(x, dtype=np.float32)


def resample(x, rate: int, target: int):
    """float32 mono at ``rate`` -> at ``target``: soxr "soxr_hq", padded or cut to
    ``resampled_length`` (transformers' load_audio, librosa.load's own steps)."""
    import numpy as np
    import soxr

    if rate == target:
        return x
    n = resampled_length(x.shape[0], rate, target)
    y = soxr.resample(np.asarray(x, dtype=np.float32), rate, target, quality="soxr_hq")
    return np.ascontiguousarray(np.pad(y, (0, max(0, n - y.shape[0])))[:n], dtype=np.float32)

