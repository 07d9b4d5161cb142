"""Gemma 4's image preprocessing with Pillow and numpy, step for step as transformers'
Gemma4ImageProcessorPil does it: the first frame, RGB (transparency laid over white), resized
with Pillow's filter (bicubic by default) to the largest size that keeps the aspect ratio,
fits ``max_soft_tokens * pooling_kernel_size**2`` patches and has both sides a multiple of
``pooling_kernel_size * patch_size``, ``x * rescale`` computed in float64 then stored as
float32 (no mean/std: the model maps [0, 1] to [-1, 1] itself), cut into patches of
``patch_size**2 * 3`` values in (row, column, channel) order, raster order over the grid.

The number of soft tokens of an image follows from its size alone (``tokens``), so a request's
text is laid out from the image headers before any image is decoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..media import gemma4_image_size, gemma4_image_tokens
from .gemma3_image import decode_rgb

BICUBIC = 3      # PIL.Image.Resampling.BICUBIC, the processor's default
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)   # the processor's allowed max_soft_tokens


@dataclass(frozen=True)
class Gemma4ImageProcessing:
    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    rescale: float = 1 / 255
    resample: int = BICUBIC

    @classmethod
    def from_hf(cls, config: dict | None, patch_size: int, pooling_kernel_size: int
                ) -> Gemma4ImageProcessing:
        """From a preprocessor config (None: the processor's defaults with the vision tower's
        patch and pooling sizes)."""
        config = config or {}
        if config.get("do_normalize"):
            mean, std = config.get("image_mean"), config.get("image_std")
            if list(mean or (0, 0, 0)) != [0, 0, 0] or list(std or (1, 1, 1)) != [1, 1, 1]:
                raise ValueError("a Gemma 4 image processor with a mean/std is not supported")
        out = cls(patch_size=int(config.get("patch_size", patch_size)),
                  max_soft_tokens=int(config.get("max_soft_tokens", cls.max_soft_tokens)),
                  pooling_kernel_size=int(config.get("pooling_kernel_size",
                                                     pooling_kernel_size)),
                  rescale=float(config.get("rescale_factor", cls.rescale)),
                  resample=int(config.get("resample", BICUBIC)))
        if out.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens {out.max_soft_tokens} is not one of "
                             f"{SOFT_TOKEN_BUDGETS}")
        return out

    @property
    def max_patches(self) -> int:
        return self.max_soft_tokens * self.pooling_kernel_size ** 2

    def target_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) the image is resized to (media.gemma4_image_size, shared with
        the API's token count)."""
        return gemma4_image_size(width, height, self.patch_size, self.max_soft_tokens,
                                 self.pooling_kernel_size)

    def tokens(self, width: int, height: int) -> int:
        """Soft tokens of an image of this size."""
        return gemma4_image_tokens(width, height, self.patch_size, self.max_soft_tokens,
                                   self.pooling_kernel_size)

    def pixels(self, url: str, max_pixels: int) -> torch.Tensor:
        """A ``data:image/...`` URL -> ``[rows, columns, patch_size**2 * 3]`` float32 patches
        in [0, 1] (the grid's shape is the patches' first two dimensions)."""
        rgb = decode_rgb(url, max_pixels)
        th, tw = self.target_size(*rgb.size)
        if rgb.size != (tw, th):
            rgb = rgb.resize((tw, th), resample=self.resample)
        x = np.asarray(rgb).transpose(2, 0, 1)                      # [3, H, W] uint8
        x = (x.astype(np.float64) * self.rescale).astype(np.float32)
        p = self.patch_size
        gh, gw = th // p, tw // p
        x = x.reshape(3, gh, p, gw, p).transpose(1, 3, 2, 4, 0).reshape(gh, gw, p * p * 3)
        return torch.from_numpy(np.ascontiguousarray(x))
