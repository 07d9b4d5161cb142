"""Gemma 4's video frames, preprocessed as transformers' Gemma4VideoProcessor does: each frame
RGB, resized to the largest size that keeps its aspect ratio within the video budget
(``max_soft_tokens``, 70 by default, times ``pooling_kernel_size**2`` patches; both sides a
multiple of ``pooling_kernel_size * patch_size``) by torchvision's resize, whose uint8 bicubic
on the CPU is torch's own antialiased ``interpolate`` on the uint8 frame (called here
directly: torchvision is not needed), then ``x / 255`` in float32 (the processor's fused
rescale and normalise with mean 0, std 1), cut into patches in (row, column, channel) order.

The processor lays a video out as each frame's ``mm:ss`` timestamp, a space, ``<boi>`` + N
video soft tokens + ``<eoi>``, frames joined by a space (Gemma4Processor.replace_video_token);
the frames go through the vision tower and embedder as images do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..media import gemma4_image_size, gemma4_image_tokens
from .gemma3_image import decode_rgb
from .gemma4_image import SOFT_TOKEN_BUDGETS


@dataclass(frozen=True)
class Gemma4VideoProcessing:
    patch_size: int = 16
    max_soft_tokens: int = 70
    pooling_kernel_size: int = 3

    @classmethod
    def from_hf(cls, config: dict | None, patch_size: int, pooling_kernel_size: int
                ) -> Gemma4VideoProcessing:
        """From a video processor config (None: the processor's defaults with the vision
        tower's patch and pooling sizes)."""
        config = config or {}
        if config.get("do_normalize", True):
            mean, std = config.get("image_mean"), config.get("image_std")
            if list(mean or (0, 0, 0)) != [0, 0, 0] or list(std or (1, 1, 1)) != [1, 1, 1]:
                raise ValueError("a Gemma 4 video processor with a mean/std is not supported")
        if config.get("resample", 3) != 3 or config.get("rescale_factor", 1 / 255) != 1 / 255:
            raise ValueError("a Gemma 4 video processor's resample and rescale_factor must be "
                             "the defaults (bicubic, 1/255)")
        out = cls(patch_size=int(config.get("patch_size", patch_size)),
                  max_soft_tokens=int(config.get("max_soft_tokens", cls.max_soft_tokens)),
                  pooling_kernel_size=int(config.get("pooling_kernel_size",
                                                     pooling_kernel_size)))
        if out.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens {out.max_soft_tokens} is not one of "
                             f"{SOFT_TOKEN_BUDGETS}")
        return out

    def tokens(self, width: int, height: int) -> int:
        """Soft tokens of a frame of this size."""
        return gemma4_image_tokens(width, height, self.patch_size, self.max_soft_tokens,
                                   self.pooling_kernel_size)

    def pixels(self, url: str, max_pixels: int) -> torch.Tensor:
        """A frame's ``data:image/...`` URL -> ``[rows, columns, patch_size**2 * 3]`` float32
        patches in [0, 1]."""
        rgb = decode_rgb(url, max_pixels)
        th, tw = gemma4_image_size(*rgb.size, self.patch_size, self.max_soft_tokens,
                                   self.pooling_kernel_size)
        x = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)[None]    # [1, 3, H, W] uint8
        if x.shape[-2:] != (th, tw):
            x = F.interpolate(x, size=[th, tw], mode="bicubic", align_corners=False,
                              antialias=True)
        x = x[0].to(torch.float32) / 255.0
        p = self.patch_size
        gh, gw = th // p, tw // p
        return x.reshape(3, gh, p, gw, p).permute(1, 3, 2, 4, 0).reshape(gh, gw, p * p * 3)
