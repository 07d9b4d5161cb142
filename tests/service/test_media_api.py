"""Media through the service: bad parts are 400s in the envelope at the API with nothing
queued; the API knows from the workers' registrations which media the served model reads
(media_not_supported before queueing); an image request scores end to end on the multimodal
model (the same bits as the engine alone, the OpenAI SDK's content parts too); remote image
URLs only where fetched, and never to a private address. A real uvicorn on loopback, real
Redis, real workers on the tiny models."""

from __future__ import annotations

import base64

import httpx
import pytest

from ..conftest import WAIT_S
from ..test_media_gemma3 import media_request, option_logprobs
from ..test_media_requests import BAD_PARTS, image_part, image_url, request_with, wav
from .live import InProcessWorker, LiveServer
from .test_api import assert_error, entries_added

AUDIO = {"type": "input_audio", "input_audio": {"data": wav(0.2), "format": "wav"}}


def test_bad_media_parts_are_400_at_the_api_before_anything_is_queued(settings):
    with LiveServer(settings) as server:    # no worker: a queued job would only wait
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for part, limits, param, code in BAD_PARTS:
            body = request_with(part, limits=limits)
            where = "messages.0.content.1" + (f".{param}" if param else "")
            for path in ("/score", "/jobs", "/chat/completions"):
                assert_error(client.post(path, json=body), 400, code, where)
        # no worker registered: media the model may read is queued, the worker judges
        ok = client.post("/score", json=request_with(image_part(image_url(0))),
                         headers={"Prefer": "respond-async"})
        assert ok.status_code == 202, ok.text
        assert entries_added(settings) == 1


def test_audio_no_decoder_reads_is_400_at_the_api_before_anything_is_queued(settings):
    """mp3 / flac / ogg / m4a / webm parts are decoded at the API (PyAV, off the event loop):
    data no decoder reads, a format other than the one declared and a part over the call's
    seconds are invalid_media in the envelope, on every route, with nothing queued; a good
    flac part is queued."""
    from ..test_media_audio_formats import b64, bad_parts, encode, part, tones

    with LiveServer(settings) as server:    # no worker: a queued job would only wait
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for bad, limits in bad_parts():
            body = request_with(bad, limits=limits)
            for path in ("/score", "/jobs", "/chat/completions"):
                assert_error(client.post(path, json=body), 400, "invalid_media",
                             "messages.0.content.1.input_audio.data")
        assert entries_added(settings) == 0
        flac = part(b64(encode(tones(16_000, 0.5), 16_000, "flac")), "flac")
        ok = client.post("/score", json=request_with(flac), headers={"Prefer": "respond-async"})
        assert ok.status_code == 202, ok.text
        assert entries_added(settings) == 1


def test_a_text_model_answers_media_not_supported_at_the_api(tiny_engine, settings):
    with LiveServer(settings) as server, InProcessWorker(tiny_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for part in (image_part(image_url(0)), AUDIO):
            for path in ("/score", "/jobs"):
                assert_error(client.post(path, json=request_with(part)), 400,
                             "media_not_supported", "messages")
        assert entries_added(settings) == 0
        model = client.get("/models").json()["models"][0]
        assert model["media"] == [] and model["features"]["media"] == []


def test_an_image_scores_end_to_end_on_the_multimodal_model(tiny_vision_engine, settings):
    request = media_request(image_url(21))
    expected = option_logprobs(tiny_vision_engine.score(request))
    with LiveServer(settings) as server, InProcessWorker(tiny_vision_engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        reply = client.post("/score", json=request)
        assert reply.status_code == 200, reply.text
        got = {(q["id"], o["text"]): o["logprob"] for q in reply.json()["results"][0]["queries"]
               for c in q["combinations"] for o in c["options"]}
        assert got == expected         # the same bits as the engine alone
        # audio: not read by this model, refused before queueing
        queued = entries_added(settings)
        assert_error(client.post("/score", json=request_with(AUDIO)), 400,
                     "media_not_supported", "messages")
        assert entries_added(settings) == queued
        model = client.get("/models").json()["models"][0]
        assert model["media"] == ["image", "video"]

        # the OpenAI SDK's content parts, unmodified
        from openai import OpenAI

        sdk = OpenAI(base_url=server.v1, api_key="unused", timeout=WAIT_S, max_retries=0)
        completion = sdk.chat.completions.create(
            model=tiny_vision_engine.model_name, messages=request["messages"],
            extra_body={"scoring": request["scoring"]})
        assert completion.choices is not None
        body = completion.model_dump()
        assert body["results"][0]["queries"][0]["id"] == "red"


def test_image_and_audio_score_end_to_end_on_gemma4(tiny_gemma4_vision_engine, settings):
    """Gemma 4 with its audio tower: an image and a WAV part score through the service with
    the engine's bits, the OpenAI SDK's input_audio part too; video is refused before
    queueing; GET /v1/models lists image and audio."""
    from ..test_media_gemma4_audio import audio_part, tone, wav_b64

    engine = tiny_gemma4_vision_engine
    request = media_request(image_url(22))
    request["messages"][0]["content"].append(audio_part(wav_b64(tone(23, 0.6))))
    expected = option_logprobs(engine.score(request))
    with LiveServer(settings) as server, InProcessWorker(engine, settings):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        reply = client.post("/score", json=request)
        assert reply.status_code == 200, reply.text
        got = {(q["id"], o["text"]): o["logprob"] for q in reply.json()["results"][0]["queries"]
               for c in q["combinations"] for o in c["options"]}
        assert got == expected
        assert reply.json()["usage"]["content"]["audio_tokens"] > 0
        model = client.get("/models").json()["models"][0]
        assert model["media"] == ["audio", "image"]
        video = {"type": "video", "video": {"frames": [{"t": 0, "image_url": {
            "url": image_url(1)}}]}}
        queued = entries_added(settings)
        assert_error(client.post("/score", json=request_with(video)), 400,
                     "media_not_supported", "messages")
        assert entries_added(settings) == queued

        from openai import OpenAI

        sdk = OpenAI(base_url=server.v1, api_key="unused", timeout=WAIT_S, max_retries=0)
        completion = sdk.chat.completions.create(
            model=engine.model_name, messages=request["messages"],
            extra_body={"scoring": request["scoring"]})
        body = completion.model_dump()
        assert {(q["id"], o["text"]): o["logprob"] for q in body["results"][0]["queries"]
                for c in q["combinations"] for o in c["options"]} == expected


def test_remote_image_urls_only_where_fetched_and_never_to_private_addresses(settings):
    remote = {"type": "image_url", "image_url": {"url": "https://127.0.0.1:9/cat.png"}}
    with LiveServer(settings) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        error = assert_error(client.post("/score", json=request_with(remote)), 400,
                             "invalid_media", "messages.0.content.1.image_url.url")
        assert "data: URL" in error["message"]
    fetching = settings.model_copy(update={"fetch_media": True})
    with LiveServer(fetching) as server:
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        for url in ("https://127.0.0.1:9/cat.png", "https://[::1]/a.png",
                    "https://169.254.169.254/latest/meta-data", "https://10.1.2.3/x.jpg"):
            part = {"type": "image_url", "image_url": {"url": url}}
            error = assert_error(client.post("/score", json=request_with(part)), 400,
                                 "invalid_media", "messages.0.content.1.image_url.url")
            assert "refused" in error["message"], error
        frames = {"type": "video", "video": {"frames": [
            {"t": 0, "image_url": {"url": image_url(0)}},
            {"t": 1, "image_url": {"url": "https://localhost/f.png"}}]}}
        assert_error(client.post("/jobs", json=request_with(frames)), 400, "invalid_media",
                     "messages.0.content.1.video.frames.1.image_url.url")
    assert entries_added(settings) == 0


@pytest.fixture
def image_server(tmp_path):
    """An https server on loopback with a self-signed certificate (openssl), serving one
    PNG at /cat.png."""
    import http.server
    import shutil
    import ssl
    import subprocess
    import threading

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test server's certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    png = base64.b64decode(image_url(5).split(",", 1)[1])

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802
            found = self.path == "/cat.png"
            self.send_response(200 if found else 404)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(png) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(png)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}", png, cert
    server.shutdown()


def test_fetching_an_https_image_through_the_guard(image_server):
    """api/media.fetch against a live https server: allowed only with the loopback listed
    (SPINF_CALLBACK_ALLOW), its bytes as served; a 404 and an image over the size cap are
    invalid_media."""
    import asyncio
    import ssl

    from api.media import fetch
    from spinf_worker.media import MediaError
    from spinf_worker.webhooks import TargetGuard

    base, png, cert = image_server

    async def get(path: str, allow=("127.0.0.1",), limit=10**6) -> bytes:
        verify = ssl.create_default_context(cafile=str(cert))
        async with httpx.AsyncClient(timeout=WAIT_S, verify=verify) as client:
            return await fetch(client, TargetGuard(allow), base + path, limit)

    assert asyncio.run(get("/cat.png")) == png
    for path, allow, limit, words in [("/cat.png", (), 10**6, "refused"),
                                      ("/dog.png", ("127.0.0.1",), 10**6, "HTTP 404"),
                                      ("/cat.png", ("127.0.0.1",), 10, "over 10 bytes")]:
        with pytest.raises(MediaError, match=words):
            asyncio.run(get(path, allow, limit))


def test_batch_lines_with_media_the_model_cannot_take_are_error_lines(tiny_vision_engine,
                                                                      settings):
    """A batch on the image model: an image line is scored; an https:// image (never
    fetched for batch lines) and an audio line are error lines, never queued."""
    import json

    from .test_batches import batch_in, lines_of, upload

    def line(custom_id: str, part: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/score",
                "body": request_with(part)}

    remote = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    content = "\n".join(json.dumps(x) for x in [
        line("image", image_part(image_url(2))), line("remote", remote),
        line("audio", AUDIO)]).encode()
    fetching = settings.model_copy(update={"fetch_media": True})
    with LiveServer(fetching) as server, InProcessWorker(tiny_vision_engine, fetching):
        client = httpx.Client(base_url=server.v1, timeout=WAIT_S)
        batch = client.post("/batches", json={"input_file_id": upload(client, content)["id"],
                                              "endpoint": "/v1/score"}).json()
        done = batch_in(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": 3, "completed": 1, "failed": 2}
        assert [x["custom_id"] for x in lines_of(client, done["output_file_id"])] == ["image"]
        errors = {e["custom_id"]: e["error"] for e in lines_of(client, done["error_file_id"])}
        assert errors["remote"]["code"] == "invalid_media"
        assert "data: URL" in errors["remote"]["message"]
        assert errors["audio"]["code"] == "media_not_supported"
    assert entries_added(settings) == 1
