"""Images read by the Gemma 4 multimodal stack (CPU), against transformers'
Gemma4ForConditionalGeneration and its Pillow image processor on a tiny random checkpoint:
the same patches, the same features, the same logprobs (|Δ| <= 1e-4), each image as many
soft tokens as its size gives, in the document's root read once with every question a
branch after it."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from . import media_oracle
from .conftest import TINY_BOS, TINY_GEMMA4_IMAGE_TOKENS
from .media_builders import assert_packed_equals_alone, two_images_request
from .test_media_gemma3 import (
    QUERIES,
    assert_floor_is_the_questions_without_the_media,
    media_request,
    option_logprobs,
    other_requests,
)
from .test_media_requests import image_part, image_url


def oracle_inputs(urls: list[str], processor_dir) -> dict:
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import (
        Gemma4ImageProcessorPil,
    )

    processor = Gemma4ImageProcessorPil.from_pretrained(processor_dir)
    images = [Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))) for u in urls]
    return processor(images=images, return_tensors="pt")


@pytest.mark.parametrize(("size", "mode", "fmt"), [
    ((45, 30), "RGB", "PNG"), ((20, 64), "RGBA", "PNG"), ((32, 32), "L", "PNG"),
    ((50, 40), "RGB", "JPEG"), ((17, 33), "RGB", "WEBP"), ((40, 40), "P", "GIF"),
    ((300, 9), "RGB", "PNG"), ((120, 120), "RGB", "PNG")])
def test_patches_equal_the_transformers_processor(tiny_gemma4_vision_engine,
                                                  tiny_gemma4_vision_dir, size, mode, fmt):
    """The same resize (aspect kept, within the soft-token budget), the same patches; the
    token count the layout reads from the header is the processor's."""
    url = image_url(1, size, "RGB" if mode == "P" else mode, fmt)
    media = tiny_gemma4_vision_engine.preparer.media
    ours = media.processing.pixels(url, 10**8)
    theirs = oracle_inputs([url], tiny_gemma4_vision_dir)
    real = int((theirs["image_position_ids"][0] != -1).all(-1).sum())
    assert ours.dtype == theirs["pixel_values"].dtype == torch.float32
    assert torch.equal(ours.reshape(real, -1), theirs["pixel_values"][0, :real])
    assert media.processing.tokens(*size) == int(theirs["num_soft_tokens_per_image"][0])


def test_image_features_equal_transformers(tiny_gemma4_vision_engine,
                                          tiny_gemma4_vision_oracle, tiny_gemma4_vision_dir):
    for size in ((45, 30), (20, 64), (300, 9)):
        url = image_url(2, size)
        inputs = oracle_inputs([url], tiny_gemma4_vision_dir)
        with torch.no_grad():
            theirs = tiny_gemma4_vision_oracle.model.get_image_features(
                inputs["pixel_values"], inputs["image_position_ids"]).pooler_output[0]
            ours = tiny_gemma4_vision_engine.model.image_features(
                tiny_gemma4_vision_engine.preparer.media.processing.pixels(url, 10**8))
        assert ours.shape == theirs.shape
        # fp32 sums in another order than transformers': up to 1.1e-5 on an AVX-512 CPU
        assert (ours - theirs).abs().max().item() <= 2e-5


def oracle_scores(oracle, engine, urls: list[str], text: str, queries) -> dict[tuple, float]:
    """Each option's logprob from one plain transformers forward per (query, option): BOS +
    the text with each ``<|image>`` expanded as the processor expands it, the template, the
    option; the image tokens marked in mm_token_type_ids (their bidirectional block)."""
    tok = engine.checkpoint.tokenizer
    boi, eoi, soft = TINY_GEMMA4_IMAGE_TOKENS
    inputs = oracle_inputs(urls, engine.checkpoint.path)
    pieces = text.split(boi)
    assert len(pieces) == len(urls) + 1
    expanded = pieces[0] + "".join(
        f"{boi}{soft * int(n)}{eoi}{piece}"
        for n, piece in zip(inputs["num_soft_tokens_per_image"], pieces[1:], strict=True))
    root = [TINY_BOS, *tok.encode(expanded, add_special_tokens=False).ids]
    return media_oracle.option_logprobs(
        oracle, tok, root, queries, media_oracle.marked("mm_token_type_ids",
                                                        tok.token_to_id(soft)),
        pixel_values=inputs["pixel_values"], image_position_ids=inputs["image_position_ids"])


def request_with(url: str) -> dict:
    request = media_request(url)
    request["messages"][0]["content"][1] = image_part(url)
    return request


@pytest.mark.parametrize("size", [(45, 30), (20, 64), (9, 9)])
def test_image_and_text_score_like_transformers(tiny_gemma4_vision_engine,
                                                tiny_gemma4_vision_oracle, size):
    url = image_url(7, size)
    ours = option_logprobs(tiny_gemma4_vision_engine.score(media_request(url)))
    theirs = oracle_scores(tiny_gemma4_vision_oracle, tiny_gemma4_vision_engine, [url],
                           f"Product photo:{TINY_GEMMA4_IMAGE_TOKENS[0]} A red kettle.",
                           QUERIES)
    assert ours.keys() == theirs.keys()
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst <= 1e-4, (worst, ours, theirs)


def test_two_images_of_different_sizes(tiny_gemma4_vision_engine, tiny_gemma4_vision_oracle):
    """Two images in one message, each its own token count; the sliding window (8) is
    shorter than an image's tokens, so the bidirectional block is cut by it on the sliding
    layers as transformers cuts it."""
    first, second = image_url(3, (30, 30)), image_url(4, (64, 16))
    ours = option_logprobs(tiny_gemma4_vision_engine.score(
        two_images_request(first, second, QUERIES)))
    boi = TINY_GEMMA4_IMAGE_TOKENS[0]
    theirs = oracle_scores(tiny_gemma4_vision_oracle, tiny_gemma4_vision_engine,
                           [first, second], f"{boi}and{boi}", QUERIES)
    assert max(abs(ours[k] - theirs[k]) for k in ours) <= 1e-4


def test_the_image_changes_the_scores_and_the_tower_runs_once(tiny_gemma4_vision_engine,
                                                             monkeypatch):
    calls = []
    model = tiny_gemma4_vision_engine.model
    original = model.encode_images
    monkeypatch.setattr(model, "encode_images",
                        lambda pixels: calls.append(len(pixels)) or original(pixels))
    first = option_logprobs(tiny_gemma4_vision_engine.score(media_request(image_url(7))))
    assert calls == [1]
    second = option_logprobs(tiny_gemma4_vision_engine.score(media_request(image_url(8))))
    assert first != second


def test_usage_counts_each_images_tokens(tiny_gemma4_vision_engine):
    media = tiny_gemma4_vision_engine.preparer.media
    sizes = [(45, 30), (20, 64)]
    request = {"messages": [{"role": "user", "content": [
        image_part(image_url(5, sizes[0])), {"type": "text", "text": "and"},
        image_part(image_url(6, sizes[1]))]}], "scoring": {"queries": QUERIES}}
    usage = tiny_gemma4_vision_engine.score(request).usage
    expected = sum(media.processing.tokens(*s) + 2 for s in sizes)
    assert media.processing.tokens(*sizes[0]) != media.processing.tokens(*sizes[1])
    assert (usage.content["images"], usage.content["image_tokens"]) == (2, expected)
    assert usage.prompt_tokens_details["image_tokens"] == expected
    assert usage.content["text_tokens"] == usage.content["tokens"] - expected


@pytest.mark.parametrize("target", ["image", "text"])
def test_bit_identical_alone_and_packed_among_text_and_image_documents(
        tiny_gemma4_vision_engine, target):
    import random

    from .test_engine_parity import NEWS

    rng = random.Random(5)
    engine = tiny_gemma4_vision_engine
    request = (media_request(image_url(9, (50, 20))) if target == "image" else
               {"text": NEWS, "scoring": {"queries": QUERIES, "case_insensitive": False}})
    assert_packed_equals_alone(engine, request,
                               lambda _: other_requests(rng, 9, max_side=90), (0, 4, 9))


def test_floor_is_the_questions_without_the_media(tiny_gemma4_vision_engine):
    assert_floor_is_the_questions_without_the_media(tiny_gemma4_vision_engine)


def test_video_is_not_read_by_gemma4_without_a_video_token(tiny_gemma4_vision_engine):
    """Gemma 4 reads frames as video tokens of their own (tests/test_media_gemma4_video.py):
    a checkpoint whose tokenizer has no ``<|video|>`` token reads no video, so a video part
    is media_not_supported, never a 500."""
    import spinf_client

    from spinf_worker.errors import InvalidRequestError

    frame = base64.b64decode(image_url(30, (40, 30), fmt="JPEG").split(",", 1)[1])
    request = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Clip:"}, spinf_client.video([(0.0, frame)])]}],
        "scoring": {"queries": QUERIES}}
    assert tiny_gemma4_vision_engine.media_kinds == ("image", "audio")
    result = tiny_gemma4_vision_engine.score_batch([request])[0]
    assert isinstance(result, InvalidRequestError), result
    assert (result.code, result.status) == ("media_not_supported", 400)


def test_a_causal_checkpoint_keeps_image_tokens_causal(tmp_path, tiny_tokenizer_dir):
    """use_bidirectional_attention unset (the smaller Gemma 4s): an image's tokens stay causal
    on every layer, as transformers masks them; the scores match it, and differ from the
    same weights read bidirectionally."""
    from spinf_worker.engine import Engine

    from .conftest import write_tiny_gemma4_vision

    path = write_tiny_gemma4_vision(tmp_path / "causal", tiny_tokenizer_dir, bidirectional=None)
    engine = Engine.load(str(path), device="cpu")
    assert engine.model.media_attention == "none"
    oracle = media_oracle.gemma4_oracle(path)
    url = image_url(7, (45, 30))
    ours = option_logprobs(engine.score(media_request(url)))
    theirs = oracle_scores(oracle, engine, [url],
                           f"Product photo:{TINY_GEMMA4_IMAGE_TOKENS[0]} A red kettle.", QUERIES)
    assert max(abs(ours[k] - theirs[k]) for k in ours) <= 1e-4
    engine.model.cfg.bidirectional_images = True     # the same weights, read both ways
    try:
        both_ways = option_logprobs(engine.score(media_request(url)))
    finally:
        engine.model.cfg.bidirectional_images = False
    assert max(abs(both_ways[k] - theirs[k]) for k in ours) > 1e-3


def test_the_released_shapes_load_every_tower_weight_by_name():
    """transformers' default Gemma 4 vision and audio configs (the released towers' shapes,
    clipped linears and standardisation on): every vision/audio tower and embedder weight of
    Gemma4ForConditionalGeneration has a parameter of the same name and shape here, and every
    parameter here has its weight (built on the meta device: nothing allocated)."""
    import transformers

    from spinf_worker.models.loader import text_config
    from spinf_worker.models.registry import GEMMA4_VISION, family_for

    cfg = transformers.Gemma4Config(
        vision_config=transformers.Gemma4VisionConfig(use_clipped_linears=True,
                                                      standardize=True),
        audio_config=transformers.Gemma4AudioConfig())
    with torch.device("meta"):
        hf = transformers.Gemma4ForConditionalGeneration(cfg)
    towers = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
    theirs = {k[len("model."):]: tuple(v.shape) for k, v in hf.state_dict().items()
              if k.startswith(tuple(f"model.{t}" for t in towers))}
    config = text_config(cfg.to_dict())
    family = family_for(config)
    assert family is GEMMA4_VISION
    with torch.device("meta"):
        model = family.build(family.config(config))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith(towers)}
    assert ours == theirs
    assert model.MEDIA == ("image", "audio")
