"""Gemma 3's image preprocessing with Pillow and numpy, step for step as transformers'
Gemma3ImageProcessor (its Pillow backend) does it: the first frame, RGB (transparency laid
over white), resized to the tower's square with Pillow's filter, ``x * rescale`` computed in
float64 then stored as float32, ``(x - mean) / std`` per channel in float32. Pan and scan
(crops of wide images) is not done: it is off in Gemma 3's processor configs.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

from ..media import MediaError, image_bytes

BILINEAR = 2     # PIL.Image.Resampling.BILINEAR, the processor's default


@dataclass(frozen=True)
class ImageProcessing:
    height: int
    width: int
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255
    resample: int = BILINEAR

    @classmethod
    def from_hf(cls, config: dict | None, image_size: int) -> ImageProcessing:
        """From a preprocessor_config.json (None: the processor's defaults at the vision
        tower's image size)."""
        config = config or {}
        if config.get("do_pan_and_scan"):
            raise ValueError("pan and scan image crops are not supported")
        size = config.get("size") or {}
        return cls(height=int(size.get("height", image_size)),
                   width=int(size.get("width", image_size)),
                   mean=tuple(config.get("image_mean", cls.mean)),
                   std=tuple(config.get("image_std", cls.std)),
                   rescale=float(config.get("rescale_factor", cls.rescale)),
                   resample=int(config.get("resample", BILINEAR)))

    def pixels(self, url: str, max_pixels: int) -> torch.Tensor:
        """A ``data:image/...`` URL -> ``[3, height, width]`` float32, normalised."""
        rgb = decode_rgb(url, max_pixels)
        if rgb.size != (self.width, self.height):
            rgb = rgb.resize((self.width, self.height), resample=self.resample)
        x = np.asarray(rgb).transpose(2, 0, 1)                      # [3, H, W] uint8
        x = (x.astype(np.float64) * self.rescale).astype(np.float32)
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        x = ((x.T - mean) / std).T
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def decode_rgb(url: str, max_pixels: int):
    """A ``data:image/...`` URL -> its (first) frame as an RGB Pillow image; ``MediaError``
    when it cannot be decoded."""
    from PIL import Image

    Image.MAX_IMAGE_PIXELS = max_pixels
    try:
        with Image.open(io.BytesIO(image_bytes(url))) as image:
            image.seek(0)            # an animation's first frame
            image.load()
            return to_rgb(image)
    except MediaError:
        raise
    except Exception as exc:          # Pillow raises many types for bad data
        raise MediaError(f"the image could not be decoded ({type(exc).__name__})",
                         param="url") from None


def to_rgb(image):
    """RGB as transformers converts it: an image with transparency over a white ground."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        ground = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(ground, rgba).convert("RGB")
    return image.convert("RGB")
