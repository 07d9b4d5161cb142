"""Media in a request's content, checked without decoding it (no Pillow, no torch): the API
tier refuses a bad part before anything is queued, and the engine decodes only what passed.

Images come as ``data:image/<png|jpeg|jpg|webp|gif>;base64,<data>`` URLs (or, where the
server allows it, ``https://`` URLs that the API fetches and inlines, api/media_fetch.py).
A part's format is read from its first bytes and its size from its header, so an image too
large (``max_image_pixels``) or not an image at all is an ``invalid_media`` 400 at once.
Audio comes as base64 in a container ``format``; a WAV file's length is read from its header.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from dataclasses import dataclass

from .errors import InvalidRequestError

IMAGE_TYPES = ("png", "jpeg", "jpg", "webp", "gif")
AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "m4a", "webm")
DETAILS = ("low", "auto", "high")
# the content part types that carry media, and the kind each is ("image", "audio", "video")
MEDIA_PARTS = {"image_url": "image", "input_audio": "audio", "video": "video"}

_DATA_URL = re.compile(r"data:image/([A-Za-z]+);base64,(.*)", re.S)


class MediaError(InvalidRequestError):
    """Media that cannot be read: a 400 ``invalid_media``."""

    code = "invalid_media"


@dataclass(frozen=True)
class ImageInfo:
    format: str      # png | jpeg | webp | gif (what the bytes are, whatever the URL said)
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


@dataclass(frozen=True)
class ImageText:
    """How a model reads an image in its text: the image part is presented as ``marker``,
    and each marker of the presented text becomes ``sequence`` before it is tokenised."""

    marker: str
    sequence: str

    @classmethod
    def gemma3(cls, boi: str, eoi: str, soft: str, tokens: int) -> ImageText:
        """Gemma 3's (transformers' Gemma3Processor): ``\\n\\n<start_of_image>`` + the soft
        tokens + ``<end_of_image>\\n\\n``."""
        return cls(boi, f"\n\n{boi}{soft * tokens}{eoi}\n\n")

    @classmethod
    def from_config(cls, config: dict, id_to_token) -> ImageText | None:
        """From a checkpoint's config.json (a Gemma 3 with a vision tower) and its
        tokenizer's ``id_to_token``; None for a model that reads no images."""
        if config.get("model_type") != "gemma3" or not config.get("vision_config"):
            return None
        ids = [config.get(f"{k}_token_id", config.get(f"{k}_token_index", default))
               for k, default in (("boi", 255999), ("eoi", 256000), ("image", 262144))]
        texts = [id_to_token(i) for i in ids]
        if None in texts:
            return None
        return cls.gemma3(*texts, int(config.get("mm_tokens_per_image", 256)))

    def expand(self, text: str) -> str:
        return text.replace(self.marker, self.sequence)


def b64decode(text: str, what: str) -> bytes:
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"the {what} is not valid base64") from None
    if not data:
        raise MediaError(f"the {what} is empty")
    return data


def is_remote(url: str) -> bool:
    return url[:8].lower() == "https://"


def image_bytes(url: str) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL."""
    found = _DATA_URL.fullmatch(url.strip())
    if found is None:
        raise MediaError("send the image as a data URL: data:image/<png|jpeg|webp|gif>;base64,"
                         "<data>" + (" (remote URLs are fetched only where the server allows "
                                     "them, and only https://)" if "://" in url[:12] else ""))
    kind = found.group(1).lower()
    if kind not in IMAGE_TYPES:
        raise MediaError(f"image type {kind!r} is not supported (png, jpeg, webp, gif)")
    return b64decode(found.group(2), "image data")


def image_info(data: bytes, max_pixels: int) -> ImageInfo:
    """The format and size an image's header declares; MediaError when the bytes are no
    image of a supported format or declare more than ``max_pixels``."""
    info = _sniff(data)
    if info is None:
        raise MediaError("the image data is not a PNG, JPEG, WebP or GIF image")
    if info.width <= 0 or info.height <= 0:
        raise MediaError("the image has no pixels")
    if info.pixels > max_pixels:
        raise MediaError(f"the image is {info.width}x{info.height} = {info.pixels:,} pixels; "
                         f"at most {max_pixels:,}")
    return info


def _sniff(data: bytes) -> ImageInfo | None:
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return ImageInfo("png", width, height)
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
        return ImageInfo("gif", width, height)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp(data)
    if data[:2] == b"\xff\xd8":
        return _jpeg(data)
    return None


def _webp(data: bytes) -> ImageInfo | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return ImageInfo("webp", width & 0x3FFF, height & 0x3FFF)
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return ImageInfo("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
    if chunk == b"VP8X" and len(data) >= 30:
        return ImageInfo("webp", int.from_bytes(data[24:27], "little") + 1,
                         int.from_bytes(data[27:30], "little") + 1)
    return None


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg(data: bytes) -> ImageInfo | None:
    """The frame size of a JPEG: its segments walked up to the first start-of-frame."""
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:              # fill byte
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):   # no length
            at += 2
            continue
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if marker in _SOF:
            if at + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return ImageInfo("jpeg", width, height)
        if length < 2:
            return None
        at += 2 + length
    return None


def audio_seconds(data: bytes, fmt: str) -> float | None:
    """A WAV file's length from its RIFF header (its data chunk over the byte rate of its fmt
    chunk); None for the other formats, whose length only a decoder knows. MediaError when a
    WAV header is unreadable."""
    if fmt != "wav":
        return None
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise MediaError("the audio is not a WAV file (no RIFF/WAVE header)")
    at, byte_rate = 12, None
    while at + 8 <= len(data):
        chunk, size = data[at:at + 4], int.from_bytes(data[at + 4:at + 8], "little")
        if chunk == b"fmt " and size >= 16 and at + 20 <= len(data):
            byte_rate = int.from_bytes(data[at + 16:at + 20], "little")
        elif chunk == b"data":
            if not byte_rate:
                break
            return min(size, len(data) - at - 8) / byte_rate
        at += 8 + size + (size & 1)
    raise MediaError("the WAV file has no readable fmt and data chunks")
