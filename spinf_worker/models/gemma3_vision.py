"""Gemma 3 multimodal (Gemma3ForConditionalGeneration): the Gemma 3 text stack with a SigLIP
vision tower and the multimodal projector in front of it.

An image is read as ``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` soft tokens +
``<end_of_image>\\n\\n`` inside the content (the processor's layout): the soft tokens' rows hold
the image's features instead of token embeddings, and attend to each other both ways (the
rest stays causal; engine/layout.py, kernels/attention.py).

The tower reads a pass's images in one run (models/media_rows.py): their patches (the patch
convolution as one linear layer over each patch's C x p x p pixels) in one buffer, each
image's padded to whole row tiles, every linear layer through the batch-invariant matmul,
attention image by image over its own patches, so an image's features depend on that image
alone. The projector average-pools the patch grid down to
``mm_tokens_per_image``, RMS-normalises and projects into the text model's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from .gemma3 import Gemma3Config, Gemma3Model
from .gemma3_image import ImageProcessing
from .layers import Linear, RMSNorm
from .media_rows import MediaRows, attend, groups


@dataclass
class SiglipConfig:
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    image_size: int = 896
    patch_size: int = 14
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf(cls, cfg: dict) -> SiglipConfig:
        if cfg.get("vision_use_head"):
            raise ValueError("a SigLIP vision tower with a pooling head is not supported")
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision activation {act!r} is not supported")
        return cls(hidden_size=cfg.get("hidden_size", 768),
                   intermediate_size=cfg.get("intermediate_size", 3072),
                   num_layers=cfg.get("num_hidden_layers", 12),
                   num_heads=cfg.get("num_attention_heads", 12),
                   image_size=cfg.get("image_size", 224), patch_size=cfg.get("patch_size", 16),
                   num_channels=cfg.get("num_channels", 3),
                   layer_norm_eps=cfg.get("layer_norm_eps", 1e-6))


@dataclass
class Gemma3VisionConfig(Gemma3Config):
    vision: SiglipConfig = field(default_factory=SiglipConfig)
    mm_tokens_per_image: int = 256
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000
    image: ImageProcessing | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma3VisionConfig:
        """``cfg``: the text config as the loader gives it, with the wrapper's
        ``vision_config``, token ids and ``mm_tokens_per_image`` (and the checkpoint's
        ``preprocessor_config`` when it has one)."""
        text = Gemma3Config.from_hf(cfg)
        vision = SiglipConfig.from_hf(cfg["vision_config"])
        tokens = int(cfg.get("mm_tokens_per_image", 256))
        side, grid = math.isqrt(tokens), vision.image_size // vision.patch_size
        if side * side != tokens or grid % side or vision.image_size % vision.patch_size:
            raise ValueError(f"{tokens} image tokens do not pool a {grid}x{grid} patch grid")
        return cls(**{f.name: getattr(text, f.name) for f in fields(Gemma3Config)},
                   vision=vision, mm_tokens_per_image=tokens,
                   image_token_id=int(cfg["image_token_id"]),
                   boi_token_id=int(cfg["boi_token_id"]), eoi_token_id=int(cfg["eoi_token_id"]),
                   image=ImageProcessing.from_hf(cfg.get("preprocessor_config"),
                                                 vision.image_size))


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.heads, self.head_dim = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.qkv_proj = Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.out_proj = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rows: MediaRows) -> torch.Tensor:
        """``x``: [rows, dim], the images' patches (``rows``: where each image's are)."""
        qkv = self.qkv_proj(x).view(x.shape[0], 3, self.heads, self.head_dim)
        out = torch.zeros_like(x)
        for s, e in rows.spans():
            out[s:e] = attend(*qkv[s:e].unbind(1), self.head_dim ** -0.5)
        return self.out_proj(out)


class SiglipMLP(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.fc1 = Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.fc2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = SiglipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = SiglipMLP(cfg)

    def forward(self, x: torch.Tensor, rows: MediaRows) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), rows)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        grid = cfg.image_size // cfg.patch_size
        self.patch_embedding = Linear(cfg.num_channels * cfg.patch_size ** 2, cfg.hidden_size,
                                      bias=True)
        self.position_embedding = nn.Embedding(grid * grid, cfg.hidden_size)


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.num_layers))


class SiglipVisionTower(nn.Module):
    def __init__(self, cfg: SiglipConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = SiglipEncoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[C, S, S]`` normalised pixels per image -> ``[patches, dim]`` per image (raster
        order), every image's rows in one buffer (models/media_rows.py)."""
        c, p = self.cfg.num_channels, self.cfg.patch_size
        g = self.cfg.image_size // p
        n = g * g
        rows = MediaRows.of([n] * len(pixels))
        patches = [x.reshape(c, g, p, g, p).permute(1, 3, 0, 2, 4).reshape(n, c * p * p)
                   for x in pixels]
        x = self.embeddings.patch_embedding(rows.pack(patches))
        x = x + rows.pack([self.embeddings.position_embedding.weight] * len(pixels))
        for layer in self.encoder.layers:
            x = layer(x, rows)
        return rows.unpack(self.post_layernorm(x))


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__()
        v = cfg.vision
        self.grid = v.image_size // v.patch_size
        self.kernel = self.grid // math.isqrt(cfg.mm_tokens_per_image)
        self.tokens = cfg.mm_tokens_per_image
        self.mm_soft_emb_norm = RMSNorm(v.hidden_size, v.layer_norm_eps, offset=1.0)
        # the checkpoint's mm_input_projection_weight is [vision, text]: stored transposed
        self.mm_input_projection = Linear(v.hidden_size, cfg.hidden_size)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[patches, vision dim]`` per image -> ``[mm_tokens_per_image, text dim]`` per
        image."""
        pooled = []
        for x in images:
            grid = x.t().reshape(1, x.shape[1], self.grid, self.grid)
            pooled.append(F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2)[0].t())
        rows = MediaRows.of([self.tokens] * len(images))
        return rows.unpack(self.mm_input_projection(self.mm_soft_emb_norm(rows.pack(pooled))))


class Gemma3VisionModel(Gemma3Model):
    """The text stack's ``forward`` with the images of the pass read first: ``plan.media``
    lists (pass row of an image's first soft token, its pixels)."""

    MEDIA = ("image", "video")     # a video: its frames, each an image after its timestamp
    MEDIA_MODULES = ("vision_tower", "multi_modal_projector")

    def __init__(self, cfg: Gemma3VisionConfig):
        super().__init__(cfg)
        self.vision_tower = SiglipVisionTower(cfg.vision)
        self.multi_modal_projector = MultiModalProjector(cfg)

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """One image's soft tokens: ``[mm_tokens_per_image, hidden]``."""
        return self.encode_images([pixels])[0]

    def encode_images(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's soft tokens, the images read together (each one's bits as alone)."""
        dtype, v = self.embed_tokens.weight.dtype, self.cfg.vision
        out = []
        for group in groups([(v.image_size // v.patch_size) ** 2] * len(pixels)):
            out += self.multi_modal_projector(
                self.vision_tower([pixels[i].to(dtype) for i in group]))
        return out

    def _embed_inputs(self, input_ids: torch.Tensor, plan) -> torch.Tensor:
        cfg = self.cfg
        if cfg.image_token_id >= cfg.vocab_size:    # a placeholder past the vocabulary
            input_ids = input_ids.masked_fill(input_ids == cfg.image_token_id, 0)
        x = self._embed(input_ids)
        media = getattr(plan, "media", None) or ()
        # the pass's images through the tower in one run, not one run per image
        features = self.encode_images([pixels.to(x.device) for _, pixels, *_ in media])
        for (row, *_), f in zip(media, features, strict=True):
            x[row:row + cfg.mm_tokens_per_image] = f
        return x

    # Weights whose checkpoint layout differs from the module's.
    def load_weight(self, weights: dict[str, torch.Tensor], name: str,
                    param: torch.Tensor) -> bool:
        if name == "vision_tower.embeddings.patch_embedding.weight":
            src = weights.get(name)
            if src is None:
                return False
            param.copy_(src.reshape(param.shape))     # [out, C, p, p] -> [out, C*p*p]
            return True
        if name == "multi_modal_projector.mm_input_projection.weight":
            src = weights.get("multi_modal_projector.mm_input_projection_weight")
            if src is None:
                return False
            param.copy_(src.t())
            return True
        return super().load_weight(weights, name, param)
