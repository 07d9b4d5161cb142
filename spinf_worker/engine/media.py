"""Images in a document's root: how the served model reads them, and where they land.

An image part is presented as the model's start-of-image text (as Gemma 3's chat template
writes an image), and the presented text's markers are then expanded to the processor's
sequence, ``\\n\\n<start_of_image>`` + N soft tokens + ``<end_of_image>\\n\\n``, before it is
tokenised, exactly as transformers' Gemma3Processor expands them. The soft tokens' rows get
the image's features in the forward (models/gemma3_vision.py) and attend to each other both
ways (kernels/attention.py). Every question stays a branch after the root: the image is
read once. floor_p is unchanged: the same questions over empty content, without media.
A video's frames are images in order, each after its ``mm:ss`` timestamp (the layout of
Gemma's video prompt; Gemma 3 has no video tokens of its own).

Gemma 4 lays an image out as ``<boi>`` + N soft tokens + ``<eoi>``, N following from the
image's size (its header's, read when the request is parsed: nothing is decoded before the
token limits); its soft tokens see each other both ways only on the sliding-window layers of
models with ``use_bidirectional_attention = "vision"`` (the model's ``media_attention``).

Audio (a Gemma 4 with an audio tower) is laid out the same way: an ``input_audio`` part is
presented as ``<boa>`` and becomes ``<boa>`` + N audio soft tokens + ``<eoa>``, N from its
length (a WAV's header; mp3, flac, ogg, m4a and webm decoded: audio_decode.py); its tokens
stay causal.

Gemma 4 reads a video as its processor lays it out: each frame ``mm:ss`` + " " + ``<boi>`` + N
video soft tokens + ``<eoi>``, frames joined by a space, N from the frame's size under the
video processor's budget (models/gemma4_video.py); a frame's tokens see each other as an
image's do.

The CPU and CUDA engines read media alike: on CUDA the root's FlexAttention rule takes each
row's media group (kernels/flex_tree.py), the towers run through the same batch-invariant
linear layers (the Triton GEMM, bf16 under every scheme: fp8 is the text stack's), and a pass
with media runs eagerly, outside the captured CUDA graphs (engine/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..media import ImageText
from ..protocol import ImageUrlPart, InputAudioPart, Message, VideoPart
from .layout import FlatDoc, ImageRows


@dataclass(frozen=True)
class MediaImage:
    """An image of a content (an image part's, or a video frame), or an audio part: where it
    is, its header."""

    url: str                      # audio: its base64 data
    param: str
    frame: bool                   # a video's frame
    width: int = 0                # from the header (0: unknown, a remote URL not inlined)
    height: int = 0
    kind: str = "image"           # "image" or "audio"
    format: str = ""              # audio: its container format
    max_seconds: float = 600      # audio: the call's max_audio_seconds (decoding stops there)


@dataclass(frozen=True)
class MediaLayout:
    """What a model that reads images needs of a document's images."""

    kinds: tuple[str, ...]        # the media kinds the model reads: ("image", "video")
    marker: str                   # how an image part is presented: "<start_of_image>"
    sequence: str                 # what each marker becomes before tokenising (fixed count)
    image_id: int                 # the soft token's id
    tokens: int                   # soft tokens per image (0: per image, from its size)
    processing: object            # models.gemma3_image / gemma4_image processing
    # a layout whose token count follows the image's size: each marker becomes
    # open + soft * N + close
    open: str = ""
    soft: str = ""
    close: str = ""
    # a model that reads audio: how an audio part is presented, and its token sequence
    # (audio_open + audio_soft * N + audio_close, N from the audio's length)
    audio_marker: str | None = None
    audio_open: str = ""
    audio_soft: str = ""
    audio_close: str = ""
    audio_id: int = -1
    audio: object = None          # models.gemma4_audio.AudioProcessing
    # a model with video tokens of its own (Gemma 4): each frame open + video_soft * N +
    # close, N from the video processor's budget
    video_soft: str = ""
    video_id: int = -1
    video: object = None          # models.gemma4_video.Gemma4VideoProcessing

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer) -> MediaLayout | None:
        kinds = getattr(model, "MEDIA", ())
        if not kinds:
            return None
        cfg = model.cfg
        boi, eoi, image = (tokenizer.id_to_token(i) for i in (
            cfg.boi_token_id, cfg.eoi_token_id, cfg.image_token_id))
        if None in (boi, eoi, image):
            raise ValueError("the tokenizer lacks the model's image tokens")
        if not hasattr(cfg, "mm_tokens_per_image"):     # Gemma 4: N from the image's size
            audio = {}
            if getattr(cfg, "audio", None) is not None:
                boa, eoa, soft = (tokenizer.id_to_token(i) for i in (
                    cfg.boa_token_id, cfg.eoa_token_id, cfg.audio_token_id))
                if None in (boa, eoa, soft):
                    raise ValueError("the tokenizer lacks the model's audio tokens")
                audio = dict(audio_marker=boa, audio_open=boa, audio_soft=soft,
                             audio_close=eoa, audio_id=cfg.audio_token_id,
                             audio=cfg.audio_processing)
            video = tokenizer.id_to_token(cfg.video_token_id)
            if video is not None and cfg.video is not None:    # its tokenizer has <|video|>
                kinds = (*kinds, "video")
                audio.update(video_soft=video, video_id=cfg.video_token_id, video=cfg.video)
            return cls(tuple(kinds), boi, "", cfg.image_token_id, 0, cfg.image,
                       open=boi, soft=image, close=eoi, **audio)
        text = ImageText.gemma3(boi, eoi, image, cfg.mm_tokens_per_image)
        return cls(tuple(kinds), text.marker, text.sequence, cfg.image_token_id,
                   cfg.mm_tokens_per_image, cfg.image)

    def images(self, messages: list[Message], where: str, max_seconds: float = 600
               ) -> tuple[list[MediaImage], int]:
        """Every image of the content in order (an image part's, a video's frames), and how
        many of them are video frames. Nothing is decoded yet."""
        out, frames = [], 0

        def one(image_url, param: str, frame: bool) -> MediaImage:
            info = image_url._info
            return MediaImage(image_url.url, param, frame, *(
                (info.width, info.height) if info is not None else (0, 0)))

        for m, message in enumerate(messages):
            for k, part in message.media_parts():
                at = f"{where}.{m}.content.{k}"
                if isinstance(part, InputAudioPart):
                    out.append(MediaImage(part.input_audio.data, f"{at}.input_audio.data",
                                          False, kind="audio",
                                          format=part.input_audio.format,
                                          max_seconds=max_seconds))
                elif isinstance(part, ImageUrlPart):
                    out.append(one(part.image_url, f"{at}.image_url.url", False))
                elif isinstance(part, VideoPart):
                    out += [one(f.image_url, f"{at}.video.frames.{j}.image_url.url", True)
                            for j, f in enumerate(part.video.frames)]
                    frames += len(part.video.frames)
        return out, frames

    def image_tokens(self, image: MediaImage) -> int:
        """Soft tokens of one image (or audio part) in this model's layout."""
        if image.kind == "audio":
            return self.audio_tokens(image)
        if self.tokens:
            return self.tokens
        processing = self.video if image.frame and self.video is not None else self.processing
        if not image.width:
            raise InvalidRequestError("send the image as a data URL", param=image.param,
                                      code="invalid_media")
        try:
            return processing.tokens(image.width, image.height)
        except InvalidRequestError as err:
            err.param = image.param
            raise

    def audio_tokens(self, part: MediaImage) -> int:
        """Soft tokens of an audio part: from its length at the extractor's rate (a WAV's
        header, another format decoded; invalid_media past the call's seconds)."""
        try:
            tokens = self.audio.tokens(self.audio.header_samples(part.url, part.format,
                                                                 part.max_seconds))
            if not tokens:
                raise InvalidRequestError("the audio is too short to read (under 40 ms)",
                                          code="invalid_media")
            return tokens
        except InvalidRequestError as err:
            err.param = part.param
            raise

    def pixels(self, images: list[MediaImage], max_pixels: int) -> list[object]:
        """The images decoded and preprocessed (an audio part: decoded to its features);
        ``invalid_media`` naming the one that is not readable."""
        out = []
        for image in images:
            try:
                if image.kind == "audio":
                    samples = self.audio.waveform(image.url, image.format, image.max_seconds)
                    if self.audio.tokens(samples.shape[0]) != self.audio_tokens(image):
                        raise InvalidRequestError("the WAV data is shorter than its header "
                                                  "says", code="invalid_media")
                    out.append(self.audio.features(samples))
                    continue
                processing = (self.video if image.frame and self.video is not None
                              else self.processing)
                out.append(processing.pixels(image.url, max_pixels))
            except InvalidRequestError as err:
                err.param = image.param
                raise
        return out

    def expand(self, text: str, images: list[MediaImage], where: str) -> str:
        """The presented text with each image (and audio) marker expanded to the model's
        sequence."""
        audio = [i for i in images if i.kind == "audio"]
        images = [i for i in images if i.kind != "audio"]
        if self.audio_marker is not None:
            if text.count(self.audio_marker) != len(audio):
                raise InvalidRequestError(
                    f"the content's text holds the model's audio marker {self.audio_marker!r}",
                    param=where, code="unsupported_content")
            pieces = text.split(self.audio_marker)
            out = [pieces[0]]
            for part, piece in zip(audio, pieces[1:], strict=True):
                out += [self.audio_open, self.audio_soft * self.audio_tokens(part),
                        self.audio_close, piece]
            text = "".join(out)
        if text.count(self.marker) != len(images):
            raise InvalidRequestError(
                f"the content's text holds the model's image marker {self.marker!r}",
                param=where, code="unsupported_content")
        if self.tokens:
            text = text.replace(self.marker, self.sequence)
        else:
            pieces = text.split(self.marker)
            out = [pieces[0]]
            for image, piece in zip(images, pieces[1:], strict=True):
                soft = self.video_soft if image.frame and self.video is not None else self.soft
                out += [self.open, soft * self.image_tokens(image), self.close, piece]
            text = "".join(out)
        return text

    def place(self, flat: FlatDoc, images: list[MediaImage], pixels: list[object],
              where: str) -> None:
        """Give a laid-out document its media: the rows of each image's (and audio part's)
        soft tokens, in the order they stand."""
        ids = flat.input_ids[:flat.root].numpy()
        rows = []
        own_video = self.video is not None      # frames under the video token (Gemma 4)
        for kind, soft_id in (("image", self.image_id), ("video", self.video_id),
                              ("audio", self.audio_id)):
            mine = [(i, p) for i, p in zip(images, pixels, strict=True)
                    if (i.kind == "audio") == (kind == "audio")
                    and (kind == "audio" or (own_video and i.frame) == (kind == "video"))]
            soft = ids == soft_id
            starts = np.flatnonzero(soft & ~np.concatenate([[False], soft[:-1]]))
            ends = np.flatnonzero(soft & ~np.concatenate([soft[1:], [False]])) + 1
            counts = [self.image_tokens(image) for image, _ in mine]
            if len(starts) != len(mine) or list(ends - starts) != counts:
                raise InvalidRequestError(f"the content's text holds the model's {kind} tokens",
                                          param=where, code="unsupported_content")
            rows += [ImageRows(int(s), int(s) + n, p, image.frame,
                               "audio" if kind == "audio" else "image",
                               p[2] if kind == "audio" else 0.0)
                     for s, n, (image, p) in zip(starts, counts, mine, strict=True)]
        flat.media = sorted(rows, key=lambda r: r.start)
