"""Media at the API, before anything is queued: a content with media the served model does
not read is ``media_not_supported`` (the kinds come from the workers' registrations), and an
image given as an ``https://`` URL is fetched here and inlined as a ``data:`` URL, so workers
never reach out. Fetching is off unless ``SPINF_FETCH_MEDIA`` is set; where a fetch may go is
the callbacks' SSRF rule (webhooks.TargetGuard, ``callback_allow``): no private, loopback or
link-local address, the checked address is the one connected to, no redirects, a size cap.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import httpx

from spinf_worker.media import MediaError, image_info, is_remote
from spinf_worker.model_names import served_names
from spinf_worker.protocol import ImageUrl, ImageUrlPart, ScoreRequest, VideoPart
from spinf_worker.request_limits import check_media_kinds
from spinf_worker.webhooks import CallbackRefused, TargetGuard

from .services import Services, Workers


def remote_images(request: ScoreRequest) -> Iterator[tuple[ImageUrl, str]]:
    """(image, param of its url) of every image given as an https:// URL."""
    for i, doc in enumerate(request.documents()):
        where = "messages" if request.inputs is None else f"inputs.{i}.messages"
        for m, message in enumerate(doc.messages):
            for k, part in message.media_parts():
                at = f"{where}.{m}.content.{k}"
                if isinstance(part, ImageUrlPart):
                    images = [(part.image_url, f"{at}.image_url.url")]
                elif isinstance(part, VideoPart):
                    images = [(f.image_url, f"{at}.video.frames.{j}.image_url.url")
                              for j, f in enumerate(part.video.frames)]
                else:
                    continue
                yield from ((image, param) for image, param in images
                            if is_remote(image.url))


def served_media(workers) -> set[str] | None:
    """The media kinds every one of the workers reads (any of them may take a job); None:
    unknown (a worker that does not say)."""
    if any(worker.media is None for worker in workers):
        return None
    return set.intersection(*(set(worker.media) for worker in workers))


async def served_kinds(services: Services, model: str | None, workers: Workers | None = None
                       ) -> tuple[str, set[str]] | None:
    """(the served model's name, the media kinds its workers read), or None when unknown
    (no worker registered, or one that does not say). ``workers``: what
    ``services.workers()`` read for this request already."""
    live, registered = workers or await services.workers()
    workers = [w for w in (live or registered)
               if model is None or model in served_names(w.model)]
    kinds = served_media(workers) if workers else None
    if kinds is None:
        return None
    return ", ".join(sorted({w.model for w in workers})), kinds


def check_kinds(request: ScoreRequest, served: tuple[str, set[str]] | None,
                *, remote: str | None = None) -> None:
    """``media_not_supported`` for media the served model does not read (``served``: from
    ``served_kinds``; None: the worker judges); ``remote``: why an https:// image left in the
    request is refused (None: it is not)."""
    if served is not None:
        model, kinds = served
        for i, doc in enumerate(request.documents()):
            where = "messages" if request.inputs is None else f"inputs.{i}"
            check_media_kinds(doc.messages, kinds, model, where)
    if remote is not None:
        for _image, param in remote_images(request):
            raise MediaError(remote, param=param)


NOT_FETCHED = ("remote image URLs are not fetched on this server; send the image as a data: "
               "URL")


async def check_media(services: Services, request: ScoreRequest,
                      workers: Workers | None = None) -> None:
    """A request's media before it is queued: kinds the served model reads, then remote
    images fetched and inlined (where the server fetches them)."""
    check_kinds(request, await served_kinds(services, request.model, workers),
                remote=None if services.settings.fetch_media else NOT_FETCHED)
    await inline_remote_images(services, request)


async def inline_remote_images(services: Services, request: ScoreRequest) -> None:
    remote = list(remote_images(request))
    if not remote:
        return
    settings = services.settings
    guard = TargetGuard(settings.callback_allow)
    limit = request.effective_limits.max_image_pixels
    async with httpx.AsyncClient(timeout=settings.media_fetch_timeout_s,
                                 follow_redirects=False) as client:
        for image, param in remote:
            try:
                data = await fetch(client, guard, image.url, settings.media_fetch_max_bytes)
                info = image_info(data, limit)
            except MediaError as err:
                err.param = param
                raise
            image.url = (f"data:image/{info.format};base64,"
                         + base64.b64encode(data).decode("ascii"))
            image._info = info


async def fetch(client: httpx.AsyncClient, guard: TargetGuard, url: str,
                max_bytes: int) -> bytes:
    """An image's bytes from an https:// URL that the guard allows."""
    try:
        target = await guard.resolve(url)
    except CallbackRefused as err:
        raise MediaError(f"the image URL is refused: {err}".replace(
            "callback_allow", "SPINF_CALLBACK_ALLOW")) from None
    if target.url.scheme != "https":
        raise MediaError("remote images are fetched over https:// only")
    headers = {"host": target.url.netloc.decode("ascii"), "accept": "image/*"}
    try:
        async with client.stream("GET", target.request_url(), headers=headers,
                                 extensions={"sni_hostname": target.url.host}) as response:
            if response.status_code != 200:
                raise MediaError(f"fetching the image answered HTTP {response.status_code}")
            data = bytearray()
            async for chunk in response.aiter_bytes():
                data += chunk
                if len(data) > max_bytes:
                    raise MediaError(f"the image is over {max_bytes:,} bytes")
    except httpx.HTTPError as err:
        raise MediaError(f"the image could not be fetched ({type(err).__name__})") from None
    if not data:
        raise MediaError("the fetched image is empty")
    return bytes(data)
