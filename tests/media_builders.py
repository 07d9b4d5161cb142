"""Media requests the CPU media tests (tests/test_media_*.py) and their GPU twins
(tests/gpu/test_gpu_media.py) both build, and the check both make that a document's bits
are the same alone and packed among others."""

from __future__ import annotations

import base64
from collections.abc import Callable

import numpy as np


def content_request(content: list[dict], queries: list[dict]) -> dict:
    """One user message of these parts, scored case-sensitively."""
    return {"messages": [{"role": "user", "content": content}],
            "scoring": {"queries": queries, "case_insensitive": False}}


def two_images_request(first: str, second: str, queries: list[dict]) -> dict:
    """``first`` and ``second`` (image URLs) around the word "and"."""
    from .test_media_requests import image_part

    return content_request([image_part(first), {"type": "text", "text": "and"},
                            image_part(second)], queries)


def image_and_audio_request(url: str, samples: np.ndarray, queries: list[dict]) -> dict:
    """An image, then an audio (int16 samples at 16 kHz) after some text; the oracle's text:
    ``f"Listing:{boi} and the seller said{boa}"``."""
    from .test_media_gemma4_audio import audio_part, wav_b64
    from .test_media_requests import image_part

    return content_request([{"type": "text", "text": "Listing:"}, image_part(url),
                            {"type": "text", "text": " and the seller said"},
                            audio_part(wav_b64(samples))], queries)


VIDEO_TIMES = (0.0, 2.5, 65.25)   # frame times of ``video_frames_request``: 00:00 00:02 01:05


def video_frames_request(frames: list[str], queries: list[dict]) -> dict:
    """A video part of these JPEG data URLs at ``VIDEO_TIMES``, as spinf_client sends it;
    the oracle's text (Gemma 3): ``f"Clip:00:00 {boi} 00:02 {boi} 01:05 {boi} The end."``."""
    import spinf_client

    video = spinf_client.video([(t, base64.b64decode(u.split(",", 1)[1]))
                                for t, u in zip(VIDEO_TIMES, frames, strict=True)])
    return content_request([{"type": "text", "text": "Clip:"}, video,
                            {"type": "text", "text": " The end."}], queries)


def assert_packed_equals_alone(engine, request: dict, others_of: Callable[[int], list[dict]],
                               positions: tuple[int, ...]) -> None:
    """``request``'s logprobs and residuals, bit for bit (float32 -> float equality), alone and
    in one pass among ``others_of(position)``'s documents at each position."""
    from .test_media_gemma3 import scores_and_residuals

    alone = scores_and_residuals(engine.score(request))
    old = engine.settings.max_pass_tokens
    engine.settings.max_pass_tokens = 1 << 20       # every document in one pass
    try:
        for position in positions:
            others = others_of(position)
            batch = others[:position] + [request] + others[position:]
            packed = engine.score_batch(batch)
            assert not any(isinstance(r, Exception) for r in packed), packed
            assert scores_and_residuals(packed[position]) == alone, position
    finally:
        engine.settings.max_pass_tokens = old
