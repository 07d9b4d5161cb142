"""Media content parts: the hosted shapes parse (spinf-client's image() and video() parts
unmodified), bad parts are 400s with the hosted codes at parse time, a model that does not
read a kind says media_not_supported, and what only decoding finds is invalid_media from
the engine."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
import spinf_client

from spinf_worker.errors import InvalidRequestError
from spinf_worker.media import audio_seconds, image_info
from spinf_worker.protocol import ScoreRequest

QUERY = {"id": "red", "template": "\nIs the picture red?\nAnswer:{?}", "options": [" yes", " no"]}
SCORING = {"queries": [QUERY], "case_insensitive": False}


def image_url(seed: int, size: tuple[int, int] = (45, 30), mode: str = "RGB",
              fmt: str = "PNG") -> str:
    """A random image as a data URL (numpy noise, so resizing has work to do)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    channels = len(mode)
    pixels = rng.integers(0, 256, size=(size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(pixels if channels > 1 else pixels[..., 0], mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def pil_image(seed: int = 0, size=(48, 36)):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def jpeg_bytes(seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    pil_image(seed).save(buffer, "JPEG")
    return buffer.getvalue()


def wav(seconds: float, rate: int = 8000) -> str:
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\0\0" * int(seconds * rate))
    return base64.b64encode(buffer.getvalue()).decode()


def request_with(*parts, limits=None) -> dict:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}],
            "scoring": SCORING}
    if limits:
        body["limits"] = limits
    return body


def parse_error(body) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        ScoreRequest.parse(body)
    return caught.value


def worker_and_api_codes(engine, body: dict, tokens) -> tuple[str | None, str | None]:
    """The error code the worker answers ``body`` with, and the API's checks (None: none)."""
    from spinf_worker.errors import SpinfError
    from spinf_worker.protocol import ScoreRequest
    from spinf_worker.request_limits import check_request

    worker = engine.score_batch([body])[0]
    try:
        check_request(ScoreRequest.parse(body), {}, tokens=tokens)
        api = None
    except SpinfError as err:
        api = err.code
    return (worker.code if isinstance(worker, SpinfError) else None), api


def test_spinf_client_parts_parse_unmodified():
    image = spinf_client.image(pil_image(), detail="low")
    video = spinf_client.video([(0.0, jpeg_bytes(1)), (0.5, jpeg_bytes(2)),
                                (61.25, jpeg_bytes(3))])
    request = ScoreRequest.parse(request_with(image, video))
    parts = request.messages[0].content
    assert parts[1].image_url.detail == "low" and parts[1].image_url._info.format == "jpeg"
    assert [f.t for f in parts[2].video.frames] == [0.0, 0.5, 61.25]
    # what the API queues is what it was sent (a frame's image gets the default detail)
    dumped = request.model_dump(mode="json", exclude_none=True)["messages"][0]["content"]
    assert dumped[1] == image
    assert dumped[2]["video"]["detail"] == "low"
    assert [(f["t"], f["image_url"]["url"]) for f in dumped[2]["video"]["frames"]] == \
        [(f["t"], f["image_url"]["url"]) for f in video["video"]["frames"]]


def png_header(width: int, height: int) -> bytes:
    """The first bytes of a PNG declaring a size (no pixel data: the header decides)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + b"\0\0\0\0"


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


BAD_PARTS = [
    # (part, limits, param below messages.0.content.1, code)
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": data_url(b"GIF89a")}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": data_url(b"not an image at all")}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(40, 40), "tiff")}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(10_000, 10_000))}}, None,
     "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": data_url(png_header(100, 100))}},
     {"max_image_pixels": 9_999}, "image_url.url", "invalid_media"),
    ({"type": "image_url", "image_url": {"url": image_url(0), "detail": "max"}}, None,
     "image_url.detail", "invalid_field"),
    ({"type": "image_url", "image_url": {}}, None, "image_url.url", "invalid_field"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, None, "image_url",
     "invalid_field"),
    ({"type": "input_audio", "input_audio": {"data": "%%%", "format": "wav"}}, None,
     "input_audio.data", "invalid_media"),
    ({"type": "input_audio", "input_audio": {"data": wav(0.1), "format": "aiff"}}, None,
     "input_audio.format", "invalid_field"),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFxxxxWAVE")
                                             .decode(), "format": "wav"}}, None,
     "input_audio.data", "invalid_media"),
    ({"type": "input_audio", "input_audio": {"data": wav(3.0), "format": "wav"}},
     {"max_audio_seconds": 2}, "input_audio.data", "invalid_media"),
    ({"type": "video", "video": {"frames": []}}, None, "video.frames", "invalid_field"),
    ({"type": "video", "video": {"frames": [{"t": 2, "image_url": {"url": image_url(0)}},
                                            {"t": 1, "image_url": {"url": image_url(1)}}]}},
     None, "video.frames.1.t", "invalid_field"),
    ({"type": "video", "video": {"frames": [{"t": -1, "image_url": {"url": image_url(0)}}]}},
     None, "video.frames.0.t", "invalid_field"),
    ({"type": "video", "video": {"frames": [{"t": "1", "image_url": {"url": image_url(0)}}]}},
     None, "video.frames.0.t", "invalid_field"),
    ({"type": "video", "video": {"frames": [{"t": True, "image_url": {"url": image_url(0)}}]}},
     None, "video.frames.0.t", "invalid_field"),
    ({"type": "video", "video": {"frames": [{"t": 0, "image_url": {"url": "data:,"}}]}},
     None, "video.frames.0.image_url.url", "invalid_media"),
    ({"type": "video", "video": {"frames": [{"t": k, "image_url": {"url": image_url(k)}}
                                            for k in range(3)]}},
     {"max_frames": 2}, "video.frames", "invalid_field"),
    ({"type": "audio", "audio": {}}, None, "", "unsupported_content"),
    ({"type": {"nested": 1}}, None, "", "unsupported_content"),
]


@pytest.mark.parametrize(("part", "limits", "param", "code"), BAD_PARTS)
def test_bad_media_parts_are_400s_with_the_hosted_codes(part, limits, param, code):
    error = parse_error(request_with(part, limits=limits))
    assert error.status == 400
    assert (error.param, error.code) == (
        "messages.0.content.1" + (f".{param}" if param else ""), code), error.message


def test_a_frame_time_must_be_finite():
    part = {"type": "video", "video": {"frames": [{"t": float("inf"),
                                                    "image_url": {"url": image_url(0)}}]}}
    error = parse_error(request_with(part))
    assert (error.param, error.code) == ("messages.0.content.1.video.frames.0.t",
                                         "invalid_field")


def test_bad_parts_in_inputs_name_the_input():
    body = {"inputs": [{"id": "a", "messages": [{"content": "fine"}]},
                       {"id": "b", "messages": [{"content": [
                           {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}]}],
            "scoring": SCORING}
    error = parse_error(body)
    assert (error.param, error.code) == ("inputs.1.messages.0.content.0.image_url.url",
                                         "invalid_media")


@pytest.mark.parametrize(("fmt", "mode"), [("PNG", "RGB"), ("JPEG", "RGB"), ("GIF", "P"),
                                           ("WEBP", "RGB"), ("WEBP", "RGBA")])
def test_image_sizes_come_from_the_header(fmt, mode):
    image = pil_image(0, (123, 45)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt, **({"lossless": True} if mode == "RGBA" else {}))
    info = image_info(buffer.getvalue(), 10**9)
    assert (info.format, info.width, info.height) == (fmt.lower(), 123, 45)


def test_wav_seconds_come_from_the_header():
    assert audio_seconds(base64.b64decode(wav(1.5)), "wav") == pytest.approx(1.5)
    assert audio_seconds(b"whatever", "mp3") is None


def test_a_text_model_answers_media_not_supported(tiny_engine):
    from spinf_worker.errors import SpinfError

    for part in (image_part(image_url(0)),
                 {"type": "input_audio", "input_audio": {"data": wav(0.2), "format": "wav"}},
                 spinf_client.video([(0.0, jpeg_bytes())])):
        result = tiny_engine.score_batch([request_with(part)])[0]
        assert isinstance(result, SpinfError)
        assert (result.status, result.code, result.param) == (400, "media_not_supported",
                                                              "messages")
        assert tiny_engine.rows(request_with({"type": "text", "text": "y"})) > 0
        with pytest.raises(InvalidRequestError, match="does not read"):
            tiny_engine.rows(request_with(part))



def test_spinf_client_image_scores_unmodified(tiny_vision_engine):
    part = spinf_client.image(pil_image(3))
    response = tiny_vision_engine.score({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Photo:"}, part]}], "scoring": SCORING})
    assert [o.text for o in response.results[0].queries[0].combinations[0].options] == \
        [" yes", " no"]


def test_the_image_model_reads_images_and_video_frames_not_audio(tiny_vision_engine):
    audio = {"type": "input_audio", "input_audio": {"data": wav(0.2), "format": "wav"}}
    body = {"inputs": [{"id": "a", "messages": [{"content": [image_part(image_url(0))]}]},
                       {"id": "b", "messages": [{"content": [audio]}]}], "scoring": SCORING}
    result = tiny_vision_engine.score_batch([body])[0]
    assert (result.code, result.param) == ("media_not_supported", "inputs.1.messages")
    assert "audio" in result.message


def test_what_only_decoding_finds_is_invalid_media_from_the_engine(tiny_vision_engine):
    """A JPEG cut short: its header passes, Pillow cannot decode it."""
    from .test_media_gemma3 import media_request

    cut = jpeg_bytes(4)[:300]
    result = tiny_vision_engine.score_batch([media_request(data_url(cut, "jpeg"))])[0]
    assert (result.status, result.code, result.param) == (
        400, "invalid_media", "messages.0.content.1.image_url.url")


def test_the_image_marker_in_text_is_refused(tiny_vision_engine):
    from .test_media_gemma3 import media_request

    body = media_request(image_url(0), before="look: <start_of_image>")
    result = tiny_vision_engine.score_batch([body])[0]
    assert (result.status, result.code) == (400, "unsupported_content")
    body = media_request(image_url(0), after="<image_soft_token>")
    result = tiny_vision_engine.score_batch([body])[0]
    assert (result.status, result.code) == (400, "unsupported_content")


def test_a_pack_written_for_text_refuses_media(tiny_vision_engine):
    """The official packs read text (their ``media``): an image under one is
    pack_media_not_supported, at the engine as at the API (request_limits)."""
    from spinf_worker.request_limits import check_request

    body = {"inputs": [{"id": "a", "messages": [{"content": "fine"}]},
                       {"id": "b", "messages": [{"content": [
                           {"type": "text", "text": "see"}, image_part(image_url(0))]}]}],
            "scoring": {"packs": [{"id": "spinf/moderation"}]}}
    result = tiny_vision_engine.score_batch([body])[0]
    assert (result.status, result.code, result.param) == (
        400, "pack_media_not_supported", "inputs.1.messages.0.content.1.type")
    with pytest.raises(InvalidRequestError) as caught:
        check_request(ScoreRequest.parse(body), tiny_vision_engine.packs, tokens=None)
    assert (caught.value.code, caught.value.param) == (result.code, result.param)


def test_the_api_counts_an_images_tokens_as_the_worker_does(tiny_vision_engine):
    """With the served model's files (api/tokens.py), the API's checks count an image's
    tokens in the processed tokens as the worker lays them out, and leave them out of the
    content limit, as the worker does: the same request passes or fails both alike."""
    from api.tokens import load

    from .conftest import TINY_MM_TOKENS
    from .test_media_gemma3 import media_request

    tokens = load(str(tiny_vision_engine.checkpoint.path))
    assert tokens.image is not None and tokens.image.marker == "<start_of_image>"
    base = media_request(image_url(4), before="Photo of a kettle:", after=" It is red.")
    doc = tiny_vision_engine.preparer.prepare_batch([base])[0].docs[0]
    rows = doc.flat.tokens

    def both(limits: dict) -> tuple:
        return worker_and_api_codes(tiny_vision_engine, {**base, "limits": limits}, tokens)

    assert both({"max_processed_tokens": rows}) == (None, None)
    assert both({"max_processed_tokens": rows - 1}) == ("request_too_large",) * 2
    # the content limit counts the text: an image's many tokens do not count in it
    content = len(tiny_vision_engine.presenter.root_ids_batch([doc.text_only])[0]) - 1
    assert content < doc.flat.root - 1 - TINY_MM_TOKENS
    assert both({"max_content_tokens": content}) == (None, None)
    assert both({"max_content_tokens": content - 1}) == ("content_too_long",) * 2
