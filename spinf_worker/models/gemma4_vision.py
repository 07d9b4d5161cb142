"""Gemma 4 with its vision tower (Gemma4ForConditionalGeneration's image path): the Gemma 4
text stack, the vision encoder and the multimodal embedder in front of it; the audio tower
too where the checkpoint has one (models/gemma4_audio.py: ``<boa>`` + N audio soft tokens +
``<eoa>``, causal like the text, their per-layer inputs the pad token's as an image's).

An image is read as ``<boi>`` + N soft tokens + ``<eoi>`` inside the content (the processor's
layout), N following from the image's size (models/gemma4_image.py: the aspect ratio is kept,
up to ``max_soft_tokens``). The soft tokens' rows hold the image's features instead of token
embeddings; their per-layer inputs read the pad token's identity, as transformers does. With
``use_bidirectional_attention = "vision"`` one image's soft tokens see each other both ways on
the sliding-window layers (the global layers stay causal); otherwise the text stays causal.

The encoder reads a pass's images in one run (models/media_rows.py): their patches (a linear
layer over each patch's ``p*p*3`` values mapped to [-1, 1]) plus learned x/y position
embeddings in one buffer, each image's padded to whole row tiles, every linear layer through
the batch-invariant matmul, attention image by image over its own patches with a 2-D RoPE
(x on the first half of each head, y on the second), so an image's features depend on that
image alone. The pooler averages ``k x k`` patches (raster order over
the pooled grid), scales by ``sqrt(hidden)`` (optionally standardised); the embedder
RMS-normalises (no weight) and projects into the text model's width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch import nn

from .gemma4 import Gemma4Config, Gemma4Model, _unit_rms
from .gemma4_audio import AudioEmbedder, AudioProcessing, Gemma4AudioTower, Gemma4AudioTowerConfig
from .gemma4_image import Gemma4ImageProcessing
from .gemma4_video import Gemma4VideoProcessing
from .layers import Linear, RMSNorm
from .media_rows import MediaRows, attend, groups


@dataclass
class Gemma4VisionTowerConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 16
    num_heads: int = 12
    num_kv_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10 * 1024
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma4VisionTowerConfig:
        act = cfg.get("hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision activation {act!r} is not supported")
        rope = cfg.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision RoPE {rope.get('rope_type')!r} is not supported")
        if cfg.get("attention_bias"):
            raise ValueError("vision attention biases are not supported")
        heads = cfg.get("num_attention_heads", 12)
        return cls(hidden_size=cfg.get("hidden_size", 768),
                   intermediate_size=cfg.get("intermediate_size", 3072),
                   num_layers=cfg.get("num_hidden_layers", 16), num_heads=heads,
                   num_kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim", 64),
                   rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                   patch_size=cfg.get("patch_size", 16),
                   pooling_kernel_size=cfg.get("pooling_kernel_size", 3),
                   position_embedding_size=cfg.get("position_embedding_size", 10 * 1024),
                   rope_theta=float(rope.get("rope_theta", 100.0)),
                   use_clipped_linears=bool(cfg.get("use_clipped_linears", False)),
                   standardize=bool(cfg.get("standardize", False)))


@dataclass
class Gemma4VisionConfig(Gemma4Config):
    vision: Gemma4VisionTowerConfig = field(default_factory=Gemma4VisionTowerConfig)
    image_token_id: int = 258880
    boi_token_id: int = 255999
    eoi_token_id: int = 258882
    pad_token_id: int = 0
    bidirectional_images: bool = False   # use_bidirectional_attention == "vision"
    image: Gemma4ImageProcessing | None = None
    # the audio tower, where the checkpoint has one (models/gemma4_audio.py)
    audio: Gemma4AudioTowerConfig | None = None
    audio_token_id: int = 258881
    boa_token_id: int = 256000
    eoa_token_id: int = 258883
    audio_processing: AudioProcessing | None = None
    # video frames: images with the video soft token and the video processor's budget
    video_token_id: int = 258884
    video: Gemma4VideoProcessing | None = None

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma4VisionConfig:
        """``cfg``: the text config as the loader gives it, with the wrapper's
        ``vision_config`` and token ids (and the checkpoint's ``preprocessor_config``)."""
        text = Gemma4Config.from_hf(cfg)
        vision = Gemma4VisionTowerConfig.from_hf(cfg["vision_config"])
        if vision.head_dim % 4:
            raise ValueError("the vision head dim must be a multiple of 4 (2-D RoPE)")
        mode = cfg.get("use_bidirectional_attention")
        image = Gemma4ImageProcessing.from_hf(cfg.get("preprocessor_config"), vision.patch_size,
                                              vision.pooling_kernel_size)
        if image.max_soft_tokens * image.pooling_kernel_size > vision.position_embedding_size:
            raise ValueError("the image processor's longest side passes the vision tower's "
                             "position embeddings")
        audio = {}
        if cfg.get("audio_config"):
            tower = Gemma4AudioTowerConfig.from_hf(cfg["audio_config"])
            audio = dict(audio=tower, audio_token_id=int(cfg["audio_token_id"]),
                         boa_token_id=int(cfg["boa_token_id"]),
                         eoa_token_id=int(cfg["eoa_token_id"]),
                         audio_processing=AudioProcessing.from_hf(
                             cfg.get("audio_preprocessor_config"),
                             int(cfg.get("audio_seq_length", 750))))
            if audio["audio_processing"].feature_size != tower.subsampling_conv_channels[0]:
                raise ValueError("the audio features' bins differ from the audio tower's "
                                 "first convolution's channels")
        video = Gemma4VideoProcessing.from_hf(cfg.get("video_preprocessor_config"),
                                              vision.patch_size, vision.pooling_kernel_size)
        return cls(**{f.name: getattr(text, f.name) for f in fields(Gemma4Config)},
                   vision=vision, image_token_id=int(cfg["image_token_id"]),
                   boi_token_id=int(cfg["boi_token_id"]), eoi_token_id=int(cfg["eoi_token_id"]),
                   pad_token_id=int(cfg.get("pad_token_id") or 0),
                   bidirectional_images=mode == "vision",
                   image=image, video_token_id=int(cfg.get("video_token_id", 258884)),
                   video=video, **audio)


class ClippableLinear(nn.Module):
    """A bias-free linear layer, its input and output clamped to stored bounds when the
    checkpoint has them (``use_clipped_linears``)."""

    def __init__(self, cfg: Gemma4VisionTowerConfig, d_in: int, d_out: int):
        super().__init__()
        self.linear = Linear(d_in, d_out)
        self.clipped = cfg.use_clipped_linears
        if self.clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.empty(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


def _rope_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: [n, heads, hd]; the first half of each head turns with the x angles, the second
    with the y angles (``cos``/``sin``: [n, 2, hd/2], rotate-half within each half)."""
    half = x.shape[-1] // 2
    out = []
    for axis, part in enumerate((x[..., :half], x[..., half:])):
        c, s = cos[:, None, axis], sin[:, None, axis]
        a, b = part[..., :half // 2], part[..., half // 2:]
        out.append(part * c + torch.cat((-b, a), dim=-1) * s)
    return torch.cat(out, dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig):
        super().__init__()
        self.cfg, hd = cfg, cfg.head_dim
        self.q_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.num_heads * hd)
        self.k_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.num_kv_heads * hd)
        self.v_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.num_kv_heads * hd)
        self.o_proj = ClippableLinear(cfg, cfg.num_heads * hd, cfg.hidden_size)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rows: MediaRows, ropes) -> torch.Tensor:
        """``x``: [rows, dim], the images' patches (``rows``: where each image's are)."""
        hd, cfg = self.cfg.head_dim, self.cfg
        q_all, k_all, v_all = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        out = torch.zeros(x.shape[0], cfg.num_heads * hd, dtype=x.dtype, device=x.device)
        group = cfg.num_heads // cfg.num_kv_heads
        for (s, e), rope in zip(rows.spans(), ropes, strict=True):
            n = e - s
            q = _rope_2d(self.q_norm(q_all[s:e].view(n, -1, hd)), *rope)
            k = _rope_2d(self.k_norm(k_all[s:e].view(n, -1, hd)), *rope)
            v = _unit_rms(v_all[s:e].view(n, -1, hd), cfg.rms_norm_eps)
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out[s:e] = attend(q, k, v, 1.0)
        return self.o_proj(out)


class VisionMLP(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig):
        super().__init__()
        self.gate_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = ClippableLinear(cfg, cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = ClippableLinear(cfg, cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class VisionLayer(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.pre_feedforward_layernorm = RMSNorm(d, eps)
        self.post_feedforward_layernorm = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, rows: MediaRows, ropes) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rows,
                                                             ropes))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class PatchEmbedder(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig):
        super().__init__()
        self.input_proj = Linear(3 * cfg.patch_size ** 2, cfg.hidden_size)
        self.position_embedding_table = nn.Parameter(
            torch.empty(2, cfg.position_embedding_size, cfg.hidden_size))


class VisionEncoder(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_layers))


class Gemma4VisionTower(nn.Module):
    def __init__(self, cfg: Gemma4VisionTowerConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedder = PatchEmbedder(cfg)
        self.encoder = VisionEncoder(cfg)
        if cfg.standardize:
            self.std_bias = nn.Parameter(torch.empty(cfg.hidden_size))
            self.std_scale = nn.Parameter(torch.empty(cfg.hidden_size))

    def _rope(self, xs: torch.Tensor, ys: torch.Tensor, dtype) -> tuple[torch.Tensor, ...]:
        hd = self.cfg.head_dim
        half = hd // 2
        inv_freq = 1.0 / (self.cfg.rope_theta ** (
            torch.arange(0, half, 2, dtype=torch.float, device=xs.device) / half))
        angles = torch.stack((xs, ys), dim=-1).float()[..., None] * inv_freq   # [n, 2, hd/4]
        angles = torch.cat((angles, angles), dim=-1)                          # [n, 2, hd/2]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """``[rows, columns, p*p*3]`` patches in [0, 1] per image -> ``[tokens, dim]``
        pooled features per image (raster order over the pooled grid), every image's rows in
        one buffer (models/media_rows.py)."""
        cfg = self.cfg
        k = cfg.pooling_kernel_size
        dtype = self.patch_embedder.input_proj.weight.dtype
        table = self.patch_embedder.position_embedding_table
        rows = MediaRows.of([gh * gw for gh, gw, _ in (p.shape for p in images)])
        flat, positions, ropes = [], [], []
        for patches in images:
            gh, gw, _ = patches.shape
            ys, xs = torch.meshgrid(torch.arange(gh, device=patches.device),
                                    torch.arange(gw, device=patches.device), indexing="ij")
            xs, ys = xs.reshape(-1), ys.reshape(-1)
            flat.append((2 * (patches.reshape(gh * gw, -1) - 0.5)).to(dtype))
            positions.append(table[0][xs] + table[1][ys])
            ropes.append(self._rope(xs, ys, dtype))
        x = self.patch_embedder.input_proj(rows.pack(flat)) + rows.pack(positions)
        for layer in self.encoder.layers:
            x = layer(x, rows, ropes)
        out = []
        for part, (gh, gw, _) in zip(rows.unpack(x), (p.shape for p in images), strict=True):
            grid = part.float().view(gh // k, k, gw // k, k, -1)
            pooled = grid.mean(dim=(1, 3)).reshape(-1, x.shape[-1]) * math.sqrt(cfg.hidden_size)
            if cfg.standardize:
                pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
            out.append(pooled.to(dtype))
        return out


class MultimodalEmbedder(nn.Module):
    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = Linear(d_in, d_out)

    def forward(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each medium's ``[tokens, d_in]`` -> ``[tokens, d_out]``, all in one buffer."""
        rows = MediaRows.of([x.shape[0] for x in parts])
        return rows.unpack(self.embedding_projection(_unit_rms(rows.pack(parts), self.eps)))


class Gemma4VisionModel(Gemma4Model):
    """The text stack's ``forward`` with the images of the pass read first: ``plan.media``
    lists (pass row of an image's first soft token, its patches)."""

    MEDIA = ("image",)
    MEDIA_MODULES = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")

    def __init__(self, cfg: Gemma4VisionConfig):
        super().__init__(cfg)
        self.vision_tower = Gemma4VisionTower(cfg.vision)
        self.embed_vision = MultimodalEmbedder(cfg.vision.hidden_size, cfg.hidden_size,
                                               cfg.vision.rms_norm_eps)
        if cfg.audio is not None:
            self.MEDIA = ("image", "audio")
            self.audio_tower = Gemma4AudioTower(cfg.audio)
            self.embed_audio = AudioEmbedder(cfg.audio.output_proj_dims, cfg.hidden_size,
                                             cfg.audio.rms_norm_eps)

    @property
    def media_attention(self) -> str:
        """Where one image's soft tokens see each other both ways: on the sliding-window
        layers only, or nowhere (kernels/attention.py, engine/runner.py)."""
        return "sliding" if self.cfg.bidirectional_images else "none"

    def image_features(self, patches: torch.Tensor) -> torch.Tensor:
        """One image's soft tokens: ``[tokens, hidden]``."""
        return self.encode_images([patches])[0]

    def audio_features(self, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One audio's soft tokens: ``[tokens, hidden]``."""
        return self.encode_audio([(features, mask)])[0]

    def encode_audio(self, audio: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> list[torch.Tensor]:
        """Each audio's soft tokens from its (log-mel features, mask), read together."""
        out = []
        # rows after the two stride-2 convolutions: ceil(ceil(frames / 2) / 2)
        for group in groups([-(-f.shape[0] // 4) for f, _ in audio]):
            out += self.embed_audio(self.audio_tower([audio[i] for i in group]))
        return out

    def encode_images(self, patches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's (or video frame's) soft tokens, the images read together (each
        one's bits as alone, whatever their sizes)."""
        out = []
        for group in groups([p.shape[0] * p.shape[1] for p in patches]):
            out += self.embed_vision(self.vision_tower([patches[i] for i in group]))
        return out

    def _embed_inputs(self, input_ids: torch.Tensor, plan) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        soft = (input_ids == cfg.image_token_id) | (input_ids == cfg.video_token_id)
        if cfg.audio is not None:
            soft |= input_ids == cfg.audio_token_id
        ids = input_ids.masked_fill(soft, cfg.pad_token_id)
        x = self._embed(ids)
        media = getattr(plan, "media", None) or ()
        # the pass's images through the tower in one run, its audio through the audio
        # tower in one, not one run per medium
        images = [(row, payload) for row, payload, kind in media if kind != "audio"]
        features = self.encode_images([p.to(x.device) for _, p in images])
        for (row, _), f in zip(images, features, strict=True):
            x[row:row + f.shape[0]] = f.to(x.dtype)
        audio = [(row, payload) for row, payload, kind in media if kind == "audio"]
        if audio:
            features = self.encode_audio([(p[0].to(x.device), p[1].to(x.device))
                                          for _, p in audio])
            for (row, _), f in zip(audio, features, strict=True):
                x[row:row + f.shape[0]] = f.to(x.dtype)
        return x, ids
