"""Images read by the Gemma 3 multimodal stack (CPU), against transformers'
Gemma3ForConditionalGeneration and its Pillow image processor on a tiny random checkpoint:
the same pixels, the same logprobs (|Δ| <= 1e-4), and the image in the document's root
read once with every question a branch after it."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from . import media_oracle
from .conftest import TINY_BOS, TINY_IMAGE_TOKENS, TINY_MM_TOKENS
from .media_builders import assert_packed_equals_alone, two_images_request, video_frames_request
from .test_media_requests import image_part, image_url

QUERIES = [
    {"id": "red", "template": "\nIs the picture red?\nAnswer:{?}", "options": [" yes", " no"]},
    {"id": "topic", "template": "\n\nTopic:{?}",
     "options": [" sports", " business", " science and climate"]},
]


def media_request(url: str, before: str = "Product photo:", after: str = " A red kettle.",
                  queries=None) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": before}, image_part(url), {"type": "text", "text": after}]}],
        "scoring": {"queries": queries or QUERIES, "case_insensitive": False}}


def oracle_pixels(url: str, processor_dir) -> torch.Tensor:
    from PIL import Image
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    processor = Gemma3ImageProcessorPil.from_pretrained(processor_dir)
    data = base64.b64decode(url.split(",", 1)[1])
    return processor(images=[Image.open(io.BytesIO(data))],
                     return_tensors="pt")["pixel_values"]


@pytest.mark.parametrize(("size", "mode", "fmt"), [
    ((45, 30), "RGB", "PNG"), ((20, 64), "RGBA", "PNG"), ((32, 32), "L", "PNG"),
    ((50, 40), "RGB", "JPEG"), ((17, 33), "RGB", "WEBP"), ((40, 40), "P", "GIF")])
def test_pixels_equal_the_transformers_processor(tiny_vision_engine, tiny_vision_dir, size,
                                                 mode, fmt):
    url = image_url(1, size, "RGB" if mode == "P" else mode, fmt)
    ours = tiny_vision_engine.preparer.media.processing.pixels(url, 10**8)
    theirs = oracle_pixels(url, tiny_vision_dir)[0]
    assert ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours, theirs)


def oracle_scores(oracle, engine, url: str | list[str], text: str, queries
                  ) -> dict[tuple, float]:
    """Each option's logprob from one plain transformers forward per (query, option): BOS +
    the text with the processor's image sequence, the template, the option."""
    tok = engine.checkpoint.tokenizer
    boi, eoi, soft = TINY_IMAGE_TOKENS
    expanded = text.replace(boi, f"\n\n{boi}{soft * TINY_MM_TOKENS}{eoi}\n\n")
    root = [TINY_BOS, *tok.encode(expanded, add_special_tokens=False).ids]
    pixels = torch.cat([oracle_pixels(u, engine.checkpoint.path)
                        for u in ([url] if isinstance(url, str) else url)])
    return media_oracle.option_logprobs(
        oracle, tok, root, queries, media_oracle.marked("token_type_ids", tok.token_to_id(soft)),
        pixel_values=pixels)


def option_logprobs(response) -> dict[tuple, float]:
    return {(q.id, o.text): o.logprob for r in response.results for q in r.queries
            for c in q.combinations for o in c.options}


def test_image_and_text_score_like_transformers(tiny_vision_engine, tiny_vision_oracle):
    url = image_url(7)
    response = tiny_vision_engine.score(media_request(url))
    ours = option_logprobs(response)
    theirs = oracle_scores(tiny_vision_oracle, tiny_vision_engine, url,
                           f"Product photo:{TINY_IMAGE_TOKENS[0]} A red kettle.", QUERIES)
    assert ours.keys() == theirs.keys()
    worst = max(abs(ours[k] - theirs[k]) for k in ours)
    assert worst <= 1e-4, (worst, ours, theirs)


def test_the_image_changes_the_scores_and_the_tower_runs_once(tiny_vision_engine,
                                                             monkeypatch):
    """Another image gives other scores (the features reach the questions), and the tower
    reads each image once per document, however many questions are asked."""
    calls = []
    model = tiny_vision_engine.model
    original = model.encode_images
    monkeypatch.setattr(model, "encode_images",
                        lambda pixels: calls.append(len(pixels)) or original(pixels))
    first = option_logprobs(tiny_vision_engine.score(media_request(image_url(7))))
    assert calls == [1]
    second = option_logprobs(tiny_vision_engine.score(media_request(image_url(8))))
    assert first != second


def test_two_images_with_a_sliding_window_shorter_than_an_image(tiny_vision_engine,
                                                                tiny_vision_oracle):
    """Two images in one message (window 8 < 16 soft tokens: the bidirectional block is
    cut by the window on sliding layers, as transformers cuts it)."""
    first, second = image_url(3, (30, 30)), image_url(4, (64, 16))
    request = two_images_request(first, second, QUERIES[:1])
    ours = option_logprobs(tiny_vision_engine.score(request))
    # the oracle with both images
    tok = tiny_vision_engine.checkpoint.tokenizer
    boi, eoi, soft = TINY_IMAGE_TOKENS
    seq = f"\n\n{boi}{soft * TINY_MM_TOKENS}{eoi}\n\n"
    root = [TINY_BOS, *tok.encode(f"{seq}and{seq}", add_special_tokens=False).ids]
    pixels = torch.cat([oracle_pixels(u, tiny_vision_engine.checkpoint.path)
                        for u in (first, second)])
    image_id = tok.token_to_id(soft)
    q = QUERIES[0]
    prefix = tok.encode(q["template"].split("{?}")[0], add_special_tokens=False).ids
    for option in q["options"]:
        ids = root + prefix + tok.encode(option, add_special_tokens=False).ids
        with torch.no_grad():
            logits = tiny_vision_oracle(
                input_ids=torch.tensor([ids]), pixel_values=pixels,
                token_type_ids=torch.tensor([[int(i == image_id) for i in ids]])).logits[0]
        expected = torch.log_softmax(logits.float(), -1)[len(ids) - 2, ids[-1]].item()
        assert abs(ours[("red", option)] - expected) <= 1e-4


def assert_floor_is_the_questions_without_the_media(engine) -> None:
    """floor_p: the same question over empty content, as for a text-only request."""
    with_image = engine.score(media_request(image_url(7)))
    text_only = engine.score({"text": "Something else entirely.",
                              "scoring": {"queries": QUERIES, "case_insensitive": False}})
    floors = [[o.floor_p for c in q.combinations for o in c.options]
              for r in (with_image.results[0], text_only.results[0]) for q in r.queries]
    assert floors[:2] == floors[2:]
    assert all(f is not None for f in floors[0])


def test_floor_is_the_questions_without_the_media(tiny_vision_engine):
    assert_floor_is_the_questions_without_the_media(tiny_vision_engine)


def other_requests(rng, count: int, max_side: int = 70) -> list[dict]:
    """Text-only and image documents of random lengths (images up to ``max_side`` pixels a
    side), other questions."""
    from .test_batch_invariance import other_request

    out = []
    for k in range(count):
        request = other_request(rng)
        request["scoring"]["case_insensitive"] = False
        if k % 2:
            words = request.pop("text")
            request["messages"] = [{"role": "user", "content": [
                {"type": "text", "text": words[:rng.randint(0, 200)]},
                image_part(image_url(100 + k, (rng.randint(8, max_side),
                                               rng.randint(8, max_side)))),
                {"type": "text", "text": words[:rng.randint(0, 50)]}]}]
        out.append(request)
    return out


def scores_and_residuals(response) -> list[float]:
    return [*option_logprobs(response).values(),
            *(c.residual for r in response.results for q in r.queries for c in q.combinations)]


@pytest.mark.parametrize("target", ["image", "text"])
def test_bit_identical_alone_and_packed_among_text_and_image_documents(tiny_vision_engine,
                                                                       target):
    import random

    from .test_engine_parity import NEWS

    rng = random.Random(5)
    request = (media_request(image_url(9)) if target == "image" else
               {"text": NEWS, "scoring": {"queries": QUERIES, "case_insensitive": False}})
    assert_packed_equals_alone(tiny_vision_engine, request, lambda _: other_requests(rng, 12),
                               (0, 5, 12))


def test_runner_raw_tensors_equal_with_images_around(tiny_vision_engine):
    """The runner's fp32 logprob tensors of an image document, torch.equal, alone and
    among other image and text documents at several offsets."""
    import random

    from .test_batch_invariance import other_request

    rng = random.Random(6)
    prepared = tiny_vision_engine.preparer.prepare_batch(
        [media_request(image_url(11))] + other_requests(rng, 8)
        + [other_request(rng) for _ in range(4)])
    docs = [d.flat for p in prepared for d in p.docs]
    target, others = docs[0], docs[1:]
    assert target.media and sum(bool(d.media) for d in others) == 4
    alone = tiny_vision_engine.runner.run([target])[0]
    for before in (1, 4, len(others)):
        packed = tiny_vision_engine.runner.run(others[:before] + [target] + others[before:])
        assert all(torch.equal(a, b) for a, b in
                   zip(alone.logprobs, packed[before].logprobs, strict=True)), before


def test_video_frames_are_images_after_their_timestamps(tiny_vision_engine,
                                                        tiny_vision_oracle):
    """A video part: each frame read as ``mm:ss`` then the image (frames joined by a space),
    scored like transformers given the frames as images in that text."""
    frames = [image_url(30 + k, (40, 30), fmt="JPEG") for k in range(3)]
    response = tiny_vision_engine.score(video_frames_request(frames, QUERIES))
    ours = option_logprobs(response)
    boi = TINY_IMAGE_TOKENS[0]
    theirs = oracle_scores(tiny_vision_oracle, tiny_vision_engine, frames,
                           f"Clip:00:00 {boi} 00:02 {boi} 01:05 {boi} The end.", QUERIES)
    assert max(abs(ours[k] - theirs[k]) for k in ours) <= 1e-4
    content = response.usage.content
    per_frame = TINY_MM_TOKENS + 2
    assert (content["images"], content["video_frames"], content["video_tokens"]) == \
        (0, 3, 3 * per_frame)
    assert content["text_tokens"] == content["tokens"] - 3 * per_frame


def test_usage_counts_image_tokens(tiny_vision_engine):
    text_only = tiny_vision_engine.score({"text": "Product photo: A red kettle.",
                                          "scoring": {"queries": QUERIES}}).usage
    with_image = tiny_vision_engine.score(media_request(image_url(7))).usage
    per_image = TINY_MM_TOKENS + 2
    assert (with_image.content["images"], with_image.content["image_tokens"]) == (1, per_image)
    assert (text_only.content["images"], text_only.content["image_tokens"]) == (0, 0)
    assert with_image.prompt_tokens_details["image_tokens"] == per_image
    # the image's tokens, the markers and the blank lines around it are the difference
    assert with_image.content["tokens"] > text_only.content["tokens"] + per_image
    assert with_image.prompt_tokens > text_only.prompt_tokens + per_image


def test_a_checkpoint_in_transformers_4_layout_loads_the_same(tiny_vision_dir, tiny_vision_engine,
                                                             tmp_path):
    """Hub checkpoints written by transformers 4 keep the tower under
    ``vision_tower.vision_model.`` and the text model under ``language_model.model.``: the
    same weights renamed so score the same bits."""
    import shutil

    from safetensors.torch import load_file, save_file

    from spinf_worker.engine import Engine

    for f in tiny_vision_dir.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    weights = load_file(tiny_vision_dir / "model.safetensors")
    renamed = {}
    for name, tensor in weights.items():
        if name.startswith("vision_tower."):
            name = "vision_tower.vision_model." + name[len("vision_tower."):]
        elif name.startswith("model.vision_tower."):
            name = "vision_tower.vision_model." + name[len("model.vision_tower."):]
        renamed[name] = tensor
    assert any(n.startswith("vision_tower.vision_model.") for n in renamed)
    save_file(renamed, tmp_path / "model.safetensors")
    legacy = Engine.load(str(tmp_path), device="cpu")
    request = media_request(image_url(7))
    assert option_logprobs(legacy.score(request)) == \
        option_logprobs(tiny_vision_engine.score(request))


def assert_extraction_after_an_image_packs_as_alone(engine) -> None:
    """An extraction slot's beams attend to the root's kept keys, image rows included: the
    answers are those of the same request decoded alone or packed with others."""
    query = {"id": "what", "template": "\nWhat is it? \"{*}\"", "max_tokens": 4}
    request = media_request(image_url(12), queries=[query, QUERIES[0]])
    alone = engine.score(request).results[0].queries[0]
    assert alone.combinations[0].answers
    packed = engine.score_batch([media_request(image_url(13)), request])[1]
    assert packed.results[0].queries[0] == alone


def test_extraction_slots_decode_after_an_image(tiny_vision_engine):
    assert_extraction_after_an_image_packs_as_alone(tiny_vision_engine)
