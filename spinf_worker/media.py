"""Media in a request's content, checked without decoding it (no Pillow, no torch): the API
tier refuses a bad part before anything is queued, and the engine decodes only what passed.

Images come as ``data:image/<png|jpeg|jpg|webp|gif>;base64,<data>`` URLs (or, where the
server allows it, ``https://`` URLs that the API fetches and inlines, api/media_fetch.py).
A part's format is read from its first bytes and its size from its header, so an image too
large (``max_image_pixels``) or not an image at all is an ``invalid_media`` 400 at once.
Audio comes as base64 in a container ``format``; a WAV file's length is read from its header,
the other formats' when decoded (audio_decode.py).
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import re
import struct
import wave
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
    def from_config(cls, config: dict, id_to_token, processor: dict | None = None
                    ) -> ImageText | SizedMediaText | None:
        """From a checkpoint's config.json (a Gemma 3 or Gemma 4 with a vision tower), its
        tokenizer's ``id_to_token`` and (Gemma 4) its processor config (preprocessor_config
        or processor_config.json); None for a model that reads no images."""
        if config.get("model_type") == "gemma4" and config.get("vision_config"):
            return _gemma4_text(config, id_to_token, processor or {})
        if config.get("model_type") != "gemma3" or not config.get("vision_config"):
            return None
        ids = [config.get(f"{k}_token_id", config.get(f"{k}_token_index", default))
               for k, default in (("boi", 255999), ("eoi", 256000), ("image", 262144))]
        texts = [id_to_token(i) for i in ids]
        if None in texts:
            return None
        return cls.gemma3(*texts, int(config.get("mm_tokens_per_image", 256)))

    audio_marker = None   # Gemma 3 reads no audio

    def expand(self, text: str, messages=()) -> str:
        return text.replace(self.marker, self.sequence)


def gemma4_image_size(width: int, height: int, patch: int, max_soft_tokens: int,
                      pooling: int) -> tuple[int, int]:
    """(height, width) Gemma 4's image processor resizes an image to: the largest that keeps
    the aspect ratio, fits ``max_soft_tokens * pooling**2`` patches and has both sides a
    multiple of ``pooling * patch`` (transformers' get_aspect_ratio_preserving_size)."""
    max_patches = max_soft_tokens * pooling ** 2
    target_px = max_patches * patch * patch
    factor = math.sqrt(target_px / (height * width))
    side = pooling * patch
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    longest = (max_patches // pooling ** 2) * side
    if th == 0 and tw == 0:
        raise MediaError("the image is too small to read")
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, longest), side
    if th * tw > target_px or th == 0 or tw == 0:
        raise MediaError(f"an image of {width}x{height} pixels cannot be read "
                         "(its aspect ratio is too extreme)")
    return th, tw


def gemma4_image_tokens(width: int, height: int, patch: int, max_soft_tokens: int,
                        pooling: int) -> int:
    """Soft tokens of an image of this size under Gemma 4's processor."""
    th, tw = gemma4_image_size(width, height, patch, max_soft_tokens, pooling)
    return (th // patch) * (tw // patch) // pooling ** 2


# Gemma 4's audio feature extractor: at most 30 s at 16 kHz are read
GEMMA4_MAX_AUDIO_SAMPLES = 480_000


def gemma4_audio_tokens(samples: int, frame_length: int = 320, hop_length: int = 160,
                        max_tokens: int = 750) -> int:
    """Audio soft tokens of ``samples`` samples at the extractor's rate (transformers'
    Gemma4Processor count: mel frames, then two stride-2 convolutions, capped)."""
    samples = min(samples, GEMMA4_MAX_AUDIO_SAMPLES)
    frames = (samples + frame_length // 2 - (frame_length + 1)) // hop_length + 1
    if frames <= 0:
        return 0
    for _ in range(2):
        frames = (frames + 2 - 3) // 2 + 1
    return min(frames, max_tokens)


def wav_length(data: bytes) -> tuple[int, int]:
    """(sample frames, rate) of a PCM WAV file, from its header (the standard library's
    ``wave``); MediaError when it is not one."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            return w.getnframes(), w.getframerate()
    except (wave.Error, EOFError, ValueError) as exc:
        raise MediaError(f"the WAV audio could not be decoded ({exc})") from None


def resampled_length(samples: int, rate: int, target: int) -> int:
    """Samples after resampling: ceil(samples * target / rate), the length transformers'
    load_audio pads or cuts its resampled audio to."""
    return samples if rate == target else -(-samples * target // rate)


@dataclass(frozen=True)
class SizedMediaText:
    """How Gemma 4 reads media in its text: an image part is presented as ``marker`` and
    becomes ``open`` + ``soft`` * N + ``close``, N from the image's size (its header); an
    audio part is presented as ``audio_marker`` and becomes ``audio_open`` + ``audio_soft``
    * N + ``audio_close``, N from its WAV header's length."""

    marker: str
    open: str
    soft: str
    close: str
    patch: int = 16
    max_soft_tokens: int = 280
    pooling: int = 3
    audio_marker: str | None = None
    audio_open: str = ""
    audio_soft: str = ""
    audio_close: str = ""
    sampling_rate: int = 16_000
    max_audio_tokens: int = 750
    # video frames under a token of their own (None: frames are read as images)
    video_soft: str | None = None
    video_max_soft_tokens: int = 70

    def image_tokens(self, width: int, height: int) -> int:
        return gemma4_image_tokens(width, height, self.patch, self.max_soft_tokens,
                                   self.pooling)

    def audio_tokens(self, length: tuple[int, int]) -> int:
        """Soft tokens of an audio part of (sample frames, rate)."""
        samples, rate = length
        return gemma4_audio_tokens(resampled_length(samples, rate, self.sampling_rate),
                                   frame_length=int(round(self.sampling_rate * 0.02)),
                                   hop_length=int(round(self.sampling_rate * 0.01)),
                                   max_tokens=self.max_audio_tokens)

    def expand(self, text: str, messages=()) -> str:
        """The presented text with each part's sequence; parts not sized (a remote image, an
        audio part not measured: protocol.measure_audio) count as their markers alone. The
        parts are told apart by their ``type`` (protocol.py imports this module)."""
        images, audio = [], []      # images: (header, a video frame)
        for message in messages:
            for _, part in message.media_parts():
                if part.type == "image_url":
                    images.append((part.image_url._info, False))
                elif part.type == "video":
                    images += [(f.image_url._info, True) for f in part.video.frames]
                elif part.type == "input_audio":
                    length = part.input_audio._length
                    audio.append(0 if length is None else self.audio_tokens(length))
        if self.audio_marker is not None and text.count(self.audio_marker) == len(audio):
            pieces = text.split(self.audio_marker)
            text = pieces[0] + "".join(
                f"{self.audio_open}{self.audio_soft * n}{self.audio_close}{piece}"
                for n, piece in zip(audio, pieces[1:], strict=True))
        if text.count(self.marker) == len(images):
            pieces = text.split(self.marker)
            out = [pieces[0]]
            for (info, frame), piece in zip(images, pieces[1:], strict=True):
                video = frame and self.video_soft is not None
                try:
                    n = 0 if info is None else gemma4_image_tokens(
                        info.width, info.height, self.patch,
                        self.video_max_soft_tokens if video else self.max_soft_tokens,
                        self.pooling)
                except MediaError:
                    n = 0
                soft = self.video_soft if video else self.soft
                out.append(f"{self.open}{soft * n}{self.close}{piece}")
            text = "".join(out)
        return text


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


def _gemma4_text(config: dict, id_to_token, processor: dict) -> SizedMediaText | None:
    image = processor.get("image_processor", processor) or {}
    vision = config["vision_config"]
    texts = [id_to_token(config.get(f"{k}_token_id", default))
             for k, default in (("boi", 255999), ("image", 258880), ("eoi", 258882))]
    if None in texts:
        return None
    audio = {}
    if config.get("audio_config"):
        ids = [config.get(f"{k}_token_id", config.get(f"{k}_token_index", default))
               for k, default in (("boa", 256000), ("audio", 258881), ("eoa", 258883))]
        atexts = [id_to_token(i) for i in ids]
        if None not in atexts:
            extractor = processor.get("feature_extractor") or {}
            audio = dict(audio_marker=atexts[0], audio_open=atexts[0], audio_soft=atexts[1],
                         audio_close=atexts[2],
                         sampling_rate=int(extractor.get("sampling_rate", 16_000)),
                         max_audio_tokens=int(processor.get("audio_seq_length", 750)))
    video = id_to_token(config.get("video_token_id", 258884))
    if video is not None:
        frames = processor.get("video_processor") or {}
        audio.update(video_soft=video,
                     video_max_soft_tokens=int(frames.get("max_soft_tokens", 70)))
    return SizedMediaText(texts[0], texts[0], texts[1], texts[2],
                          patch=int(image.get("patch_size", vision.get("patch_size", 16))),
                          max_soft_tokens=int(image.get("max_soft_tokens", 280)),
                          pooling=int(image.get("pooling_kernel_size",
                                                vision.get("pooling_kernel_size", 3))),
                          **audio)
