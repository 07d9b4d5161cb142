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

Only the CPU engine reads images for now: the CUDA attention has no bidirectional image
blocks, so there a media part is ``media_not_supported``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..media import ImageText
from ..protocol import ImageUrlPart, Message, VideoPart
from .layout import FlatDoc, ImageRows


@dataclass(frozen=True)
class MediaLayout:
    """What a model that reads images needs of a document's images."""

    kinds: tuple[str, ...]        # the media kinds the model reads: ("image", "video")
    marker: str                   # how an image part is presented: "<start_of_image>"
    sequence: str                 # what each marker becomes before tokenising
    image_id: int                 # the soft token's id
    tokens: int                   # soft tokens per image
    processing: object            # models.gemma3_image.ImageProcessing

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer, device: torch.device
                  ) -> MediaLayout | None:
        kinds = getattr(model, "MEDIA", ())
        if not kinds or device.type != "cpu":
            return None
        cfg = model.cfg
        boi, eoi, image = (tokenizer.id_to_token(i) for i in (
            cfg.boi_token_id, cfg.eoi_token_id, cfg.image_token_id))
        if None in (boi, eoi, image):
            raise ValueError("the tokenizer lacks the model's image tokens")
        text = ImageText.gemma3(boi, eoi, image, cfg.mm_tokens_per_image)
        return cls(tuple(kinds), text.marker, text.sequence, cfg.image_token_id,
                   cfg.mm_tokens_per_image, cfg.image)

    def images(self, messages: list[Message], where: str
               ) -> tuple[list[tuple[str, str]], int]:
        """(url, param) of every image of the content in order (an image part's, a video's
        frames), and how many of them are video frames. Nothing is decoded yet."""
        out, frames = [], 0
        for m, message in enumerate(messages):
            for k, part in message.media_parts():
                at = f"{where}.{m}.content.{k}"
                if isinstance(part, ImageUrlPart):
                    out.append((part.image_url.url, f"{at}.image_url.url"))
                elif isinstance(part, VideoPart):
                    out += [(f.image_url.url, f"{at}.video.frames.{j}.image_url.url")
                            for j, f in enumerate(part.video.frames)]
                    frames += len(part.video.frames)
        return out, frames

    def pixels(self, images: list[tuple[str, str]], max_pixels: int) -> list[torch.Tensor]:
        """The images decoded and preprocessed; ``invalid_media`` naming the one that is
        not readable."""
        out = []
        for url, param in images:
            try:
                out.append(self.processing.pixels(url, max_pixels))
            except InvalidRequestError as err:
                err.param = param
                raise
        return out

    def expand(self, text: str, images: int, where: str) -> str:
        """The presented text with each image marker expanded to the model's sequence."""
        if text.count(self.marker) != images:
            raise InvalidRequestError(
                f"the content's text holds the model's image marker {self.marker!r}",
                param=where, code="unsupported_content")
        return text.replace(self.marker, self.sequence)

    def place(self, flat: FlatDoc, pixels: list[torch.Tensor], where: str) -> None:
        """Give a laid-out document its images: the rows of each image's soft tokens."""
        ids = flat.input_ids[:flat.root].numpy()
        soft = ids == self.image_id
        starts = np.flatnonzero(soft & ~np.concatenate([[False], soft[:-1]]))
        if len(starts) != len(pixels) or int(soft.sum()) != len(pixels) * self.tokens:
            raise InvalidRequestError("the content's text holds the model's image tokens",
                                      param=where, code="unsupported_content")
        flat.media = [ImageRows(int(s), int(s) + self.tokens, p)
                      for s, p in zip(starts, pixels, strict=True)]
