"""Video read by the Gemma 4 multimodal stack (CPU), against transformers'
Gemma4ForConditionalGeneration on a tiny random checkpoint with a ``<|video|>`` token: each
frame laid out as Gemma4Processor.replace_video_token writes it (``mm:ss <boi>`` + N video
tokens + ``<eoi>``, frames joined by a space), its patches as Gemma4VideoProcessor makes them,
the same logprobs (|Δ| <= 1e-4), bit-identical alone and packed, the frames cap.

transformers' video processor needs torchvision, which does not load against the CPU torch
here: the oracle's patches follow its steps (video_processing_gemma4._preprocess) with the
call torchvision's resize makes for uint8 frames on the CPU (torch's antialiased bicubic
``interpolate``), all frames of a video as one [T, C, H, W] tensor."""

from __future__ import annotations

import base64
import inspect
import io

import numpy as np
import pytest
import torch

from . import media_oracle
from .conftest import TINY_BOS, TINY_GEMMA4_IMAGE_TOKENS, TINY_GEMMA4_PATCH, TINY_GEMMA4_VIDEO_TOKEN
from .media_builders import assert_packed_equals_alone
from .test_media_gemma3 import QUERIES, option_logprobs, other_requests
from .test_media_requests import image_url, worker_and_api_codes


def video_part(urls: list[str], times: list[float]) -> dict:
    return {"type": "video", "video": {"frames": [
        {"t": t, "image_url": {"url": u}} for u, t in zip(urls, times, strict=True)]}}


def video_request(urls: list[str], times: list[float]) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Clip:"}, video_part(urls, times),
        {"type": "text", "text": " A kettle."}]}],
        "scoring": {"queries": QUERIES, "case_insensitive": False}}


def oracle_video(urls: list[str], budget: int = 70, pooling: int = 3) -> dict:
    """Gemma4VideoProcessor's outputs for one video of these frames (one size)."""
    from PIL import Image

    from spinf_worker.media import gemma4_image_size

    p = TINY_GEMMA4_PATCH
    frames = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1])))
                                  .convert("RGB")) for u in urls])
    video = torch.from_numpy(frames).permute(0, 3, 1, 2)        # [T, C, H, W] uint8
    th, tw = gemma4_image_size(video.shape[-1], video.shape[-2], p, budget, pooling)
    if (th, tw) != tuple(video.shape[-2:]):
        video = torch.nn.functional.interpolate(video, size=[th, tw], mode="bicubic",
                                                align_corners=False, antialias=True)
    video = video.to(torch.float32).sub_(torch.zeros(3)[:, None, None]).div_(
        (torch.ones(3) * (1.0 / (1 / 255)))[:, None, None])
    t, gh, gw = video.shape[0], th // p, tw // p
    patches = video.reshape(t, 3, gh, p, gw, p).permute(0, 2, 4, 3, 5, 1).reshape(t, gh * gw, -1)
    grid = torch.stack(torch.meshgrid(torch.arange(gw), torch.arange(gh), indexing="xy"), -1)
    positions = grid.reshape(gh * gw, 2)[None].repeat(t, 1, 1)
    pad = budget * pooling ** 2 - gh * gw
    patches = torch.nn.functional.pad(patches, (0, 0, 0, pad))
    positions = torch.nn.functional.pad(positions, (0, 0, 0, pad), value=-1)
    return {"pixel_values_videos": patches, "video_position_ids": positions,
            "num_frames_per_video": torch.tensor([t]), "tokens": gh * gw // pooling ** 2}


def test_frame_patches_equal_the_video_processors(tiny_gemma4_video_engine):
    media = tiny_gemma4_video_engine.preparer.media
    assert "video" in media.kinds
    for size in ((45, 30), (20, 64), (9, 9), (300, 9)):
        url = image_url(11, size)
        ours = media.video.pixels(url, 10**8)
        theirs = oracle_video([url])
        assert media.video.tokens(*size) == theirs["tokens"]
        real = ours.shape[0] * ours.shape[1]
        assert torch.equal(ours.reshape(real, -1), theirs["pixel_values_videos"][0, :real])


def oracle_scores(oracle, engine, urls: list[str], times: list[float]) -> dict:
    tok = engine.checkpoint.tokenizer
    boi, eoi, _ = TINY_GEMMA4_IMAGE_TOKENS
    inputs = oracle_video(urls)
    n = inputs.pop("tokens")
    frames = " ".join(f"{int(t // 60):02d}:{int(t % 60):02d} {boi}{TINY_GEMMA4_VIDEO_TOKEN * n}"
                      f"{eoi}" for t in times)
    root = [TINY_BOS, *tok.encode(f"Clip:{frames} A kettle.", add_special_tokens=False).ids]
    if "num_frames_per_video" not in inspect.signature(oracle.model.get_video_features).parameters:
        # transformers before 5.25: one [videos, frames, ...] axis each, no frame counts
        inputs = {"pixel_values_videos": inputs["pixel_values_videos"][None],
                  "video_position_ids": inputs["video_position_ids"][None]}
    video_id = tok.token_to_id(TINY_GEMMA4_VIDEO_TOKEN)
    return media_oracle.option_logprobs(
        oracle, tok, root, QUERIES, media_oracle.marked("mm_token_type_ids", video_id, 2),
        **inputs)


@pytest.mark.parametrize("size", [(45, 30), (24, 60)])
def test_a_video_scores_like_transformers(tiny_gemma4_video_engine, tiny_gemma4_video_oracle,
                                          size):
    urls, times = [image_url(20 + k, size) for k in range(3)], [0.0, 1.5, 75.2]
    ours = option_logprobs(tiny_gemma4_video_engine.score(video_request(urls, times)))
    theirs = oracle_scores(tiny_gemma4_video_oracle, tiny_gemma4_video_engine, urls, times)
    assert ours.keys() == theirs.keys()
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst <= 1e-4, (worst, ours, theirs)


def test_usage_and_the_apis_count_match_the_worker(tiny_gemma4_video_engine):
    from api.tokens import load

    engine = tiny_gemma4_video_engine
    urls = [image_url(30 + k, (40, 28)) for k in range(2)]
    body = video_request(urls, [0, 2])
    rows = engine.preparer.prepare_batch([body])[0].docs[0].flat.tokens
    usage = engine.score(body).usage
    assert (usage.content["video_frames"], usage.content["video_tokens"]) == (
        2, 2 * (engine.preparer.media.video.tokens(40, 28) + 2))
    tokens = load(str(engine.checkpoint.path))
    for limit, code in ((rows, None), (rows - 1, "request_too_large")):
        limited = {**body, "limits": {"max_processed_tokens": limit}}
        assert worker_and_api_codes(engine, limited, tokens) == (code, code)


def test_the_frames_cap(tiny_gemma4_video_engine):
    from spinf_worker.errors import InvalidRequestError

    urls = [image_url(40 + k, (20, 20)) for k in range(3)]
    body = {**video_request(urls, [0, 1, 2]), "limits": {"max_frames": 2}}
    error = tiny_gemma4_video_engine.score_batch([body])[0]
    assert isinstance(error, InvalidRequestError)
    assert (error.code, error.param) == ("invalid_field", "messages.0.content.1.video.frames")
    body["limits"]["max_frames"] = 3
    assert not isinstance(tiny_gemma4_video_engine.score_batch([body])[0], Exception)


def assert_video_packs_as_alone(engine) -> None:
    """A request of two videos scored alone and packed among text, image and video
    documents at several places: the same bits."""
    import random

    rng = random.Random(12)
    request = video_request([image_url(50 + k, (36, 24)) for k in range(2)], [0, 3])

    def others(position: int) -> list[dict]:
        out = other_requests(rng, 6, max_side=90)
        out[2] = video_request([image_url(60 + position, (50, 30))], [1])
        return out

    assert_packed_equals_alone(engine, request, others, (0, 3, 6))


def test_bit_identical_alone_and_packed_among_text_image_and_video_documents(
        tiny_gemma4_video_engine):
    assert_video_packs_as_alone(tiny_gemma4_video_engine)
