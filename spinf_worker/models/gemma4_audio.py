"""Gemma 4's audio path (Gemma4ForConditionalGeneration's audio tower): the log-mel features
as transformers' Gemma4AudioFeatureExtractor computes them (numpy), and the audio encoder
(a Universal Speech Model conformer) as a module.

Audio arrives as a WAV file (decoded with the standard library's ``wave``: 8/16/24/32-bit PCM,
channels averaged) or as mp3, flac, ogg, m4a or webm (decoded by PyAV: audio_decode.py),
resampled to the extractor's rate (16 kHz) as transformers' load_audio resamples (soxr) when it
has another, and cut at the extractor's 30 seconds. The extractor pads the
samples to a multiple of 128, frames them (20 ms windows every 10 ms, half a window of
silence before), takes a periodic Hann window, an FFT, an HTK mel filter bank and a log with
a floor; frames past the audio are zero. The encoder reads a pass's audio in one run
(models/media_rows.py: every linear layer and norm once over one buffer, each audio's rows
tile-aligned; convolutions and attention audio by audio over its own frames): two stride-2
convolutions (each with a LayerNorm and ReLU, the padding frames zeroed before them), a
projection, then conformer layers (half-step feed-forward, chunked local self-attention
with a learned relative position term and a logit soft cap, a light causal depthwise
convolution, half-step feed-forward), an output projection; the embedder RMS-normalises
(no weight) and projects into the text model's width. Every 4 mel frames (40 ms) are one
soft token; the audio's tokens are those its real frames reach.
"""

from __future__ import annotations

import io
import math
import wave
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..audio_decode import audio_length, decode_mono, resample
from ..media import (
    GEMMA4_MAX_AUDIO_SAMPLES,
    MediaError,
    b64decode,
    gemma4_audio_tokens,
    resampled_length,
)
from .gemma4 import _unit_rms
from .layers import Linear, RMSNorm
from .media_rows import MediaRows, tile_rows

MAX_SAMPLES = GEMMA4_MAX_AUDIO_SAMPLES   # the extractor's max_length (30 s at 16 kHz)
PAD_MULTIPLE = 128           # the extractor's pad_to_multiple_of


@dataclass(frozen=True)
class AudioProcessing:
    """Gemma4AudioFeatureExtractor's settings (its preprocessor config)."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    frame_length_ms: float = 20.0
    hop_length_ms: float = 10.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    mel_floor: float = 1e-3
    max_tokens: int = 750        # the processor's audio_seq_length

    @classmethod
    def from_hf(cls, config: dict | None, max_tokens: int = 750) -> AudioProcessing:
        config = config or {}
        for key, off in (("preemphasis", 0.0), ("dither", 0.0), ("input_scale_factor", 1.0),
                         ("fft_overdrive", False), ("per_bin_mean", None),
                         ("per_bin_stddev", None)):
            if config.get(key, off) != off:
                raise ValueError(f"audio feature extractor setting {key} is not supported")
        return cls(feature_size=int(config.get("feature_size", 128)),
                   sampling_rate=int(config.get("sampling_rate", 16_000)),
                   frame_length_ms=float(config.get("frame_length_ms", 20.0)),
                   hop_length_ms=float(config.get("hop_length_ms", 10.0)),
                   min_frequency=float(config.get("min_frequency", 0.0)),
                   max_frequency=float(config.get("max_frequency", 8000.0)),
                   mel_floor=float(config.get("mel_floor", 1e-3)),
                   max_tokens=max_tokens)

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    def tokens(self, samples: int) -> int:
        """Soft tokens of ``samples`` samples at the extractor's rate (the processor's
        count: mel frames, then two stride-2 convolutions, at most ``max_tokens``;
        media.gemma4_audio_tokens, shared with the API's token count)."""
        return gemma4_audio_tokens(samples, self.frame_length, self.hop_length,
                                   self.max_tokens)

    def header_samples(self, data: str, fmt: str, max_seconds: float = 600) -> int:
        """Samples at the extractor's rate of a base64 audio part: a WAV's from its header,
        another format's by decoding it (audio_decode.audio_length, cached)."""
        n, rate = audio_length(data, fmt, max_seconds)
        return resampled_length(n, rate, self.sampling_rate)

    def waveform(self, data: str, fmt: str, max_seconds: float = 600) -> np.ndarray:
        """A base64 audio part -> float32 mono samples at the extractor's rate."""
        if fmt != "wav":
            samples, rate = decode_mono(data, fmt, max_seconds)
            return resample(samples, rate, self.sampling_rate)
        try:
            with wave.open(io.BytesIO(b64decode(data, "audio data"))) as w:
                width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
                raw = w.readframes(w.getnframes())
        except MediaError:
            raise
        except (wave.Error, EOFError, ValueError) as exc:
            raise MediaError(f"the WAV audio could not be decoded ({exc})", param="data") from None
        samples = pcm_samples(raw, width, channels)
        if rate != self.sampling_rate:
            samples = resample(samples, rate, self.sampling_rate)
        return samples

    def features(self, samples: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, float]:
        """float32 samples -> ([frames, feature_size] float32 log-mel, [frames] bool mask,
        the seconds read), as the extractor computes them for one audio."""
        samples = np.asarray(samples, dtype=np.float32)[:MAX_SAMPLES]
        n = samples.shape[0]
        padded = -(-n // PAD_MULTIPLE) * PAD_MULTIPLE
        waveform = np.zeros((1, padded), dtype=np.float32)
        waveform[0, :n] = samples
        mask = np.zeros(padded, dtype=np.int32)
        mask[:n] = 1
        frame, hop = self.frame_length, self.hop_length
        fft_length = 2 ** math.ceil(math.log2(frame))
        pad_left = frame // 2
        waveform = np.pad(waveform, ((0, 0), (pad_left, 0)), mode="constant")
        mask = np.pad(mask, (pad_left, 0), mode="constant", constant_values=0)
        size = frame + 1
        count = (waveform.shape[1] - size) // hop + 1
        if count <= 0:
            raise MediaError("the audio is too short to read", param="data")
        frames = np.lib.stride_tricks.as_strided(
            waveform, shape=(1, count, size),
            strides=(waveform.strides[0], waveform.strides[1] * hop, waveform.strides[1]))
        window = np.hanning(frame + 1)[:-1].astype(np.float32)
        spectrum = np.abs(np.fft.rfft(frames[..., :-1] * window, n=fft_length, axis=-1))
        log_mel = np.log(np.matmul(spectrum, self.mel_filters(fft_length // 2 + 1))
                         + np.array(self.mel_floor, dtype=np.float64))[0]
        valid = mask[np.arange(count) * hop + size - 1].astype(bool)
        log_mel = log_mel.astype(np.float32) * valid[:, None]
        return (torch.from_numpy(np.ascontiguousarray(log_mel)), torch.from_numpy(valid),
                n / self.sampling_rate)

    def mel_filters(self, bins: int) -> np.ndarray:
        """[bins, feature_size] float64 HTK triangular filters, no normalisation."""
        def to_mel(f):
            return 2595.0 * np.log10(1.0 + f / 700.0)

        mels = np.linspace(to_mel(self.min_frequency), to_mel(self.max_frequency),
                           self.feature_size + 2)
        centres = 700.0 * (np.power(10, mels / 2595.0) - 1.0)
        fft_freqs = np.linspace(0, self.sampling_rate // 2, bins)
        diff = np.diff(centres)
        slopes = np.expand_dims(centres, 0) - np.expand_dims(fft_freqs, 1)
        down = -slopes[:, :-2] / diff[:-1]
        up = slopes[:, 2:] / diff[1:]
        return np.maximum(np.zeros(1), np.minimum(down, up))


def pcm_samples(raw: bytes, width: int, channels: int) -> np.ndarray:
    """Interleaved PCM frames -> float32 mono in [-1, 1] (channels averaged); a truncated
    last frame is dropped."""
    raw = raw[:len(raw) - len(raw) % (width * channels)] if width * channels else raw
    if width == 1:
        x = (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        x = (np.where(v >= 1 << 23, v - (1 << 24), v)).astype(np.float32) / float(1 << 23)
    elif width == 4:
        x = (np.frombuffer(raw, dtype="<i4").astype(np.float64) / float(1 << 31)
             ).astype(np.float32)
    else:
        raise MediaError(f"{8 * width}-bit WAV audio is not supported", param="data")
    if channels > 1:
        x = x[:x.shape[0] - x.shape[0] % channels].reshape(-1, channels).mean(axis=1)
    return x.astype(np.float32)


@dataclass
class Gemma4AudioTowerConfig:
    hidden_size: int = 1024
    num_layers: int = 12
    num_heads: int = 8
    subsampling_conv_channels: tuple[int, int] = (128, 32)
    conv_kernel_size: int = 5
    residual_weight: float = 0.5
    attention_chunk_size: int = 12
    attention_context_left: int = 13
    attention_context_right: int = 0
    attention_logit_cap: float = 50.0
    attention_invalid_logits_value: float = -1.0e9
    use_clipped_linears: bool = True
    rms_norm_eps: float = 1e-6
    gradient_clipping: float = 1e10
    output_proj_dims: int = 1536
    feature_size: int = 128

    @classmethod
    def from_hf(cls, cfg: dict) -> Gemma4AudioTowerConfig:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"audio activation {cfg['hidden_act']!r} is not supported")
        out = cls(**{k: cfg[k] for k in (
            "hidden_size", "conv_kernel_size", "residual_weight", "attention_chunk_size",
            "attention_context_left", "attention_context_right", "attention_logit_cap",
            "attention_invalid_logits_value", "use_clipped_linears", "rms_norm_eps",
            "gradient_clipping", "output_proj_dims") if k in cfg})
        out.num_layers = cfg.get("num_hidden_layers", out.num_layers)
        out.num_heads = cfg.get("num_attention_heads", out.num_heads)
        out.subsampling_conv_channels = tuple(cfg.get("subsampling_conv_channels",
                                                      out.subsampling_conv_channels))
        return out


class ClippedLinear(nn.Module):
    """A bias-free linear layer clamped to stored input/output bounds (clipped linears)."""

    def __init__(self, clipped: bool, d_in: int, d_out: int):
        super().__init__()
        self.linear = Linear(d_in, d_out)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                setattr(self, name, nn.Parameter(torch.empty(())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        x = self.linear(x)          # x: a tower run's buffer, whole row tiles
        if self.clipped:
            x = torch.clamp(x, self.output_min, self.output_max)
        return x


def _clip(x: torch.Tensor, limit: float) -> torch.Tensor:
    limit = min(limit, torch.finfo(x.dtype).max)
    return torch.clamp(x, -limit, limit)


class SubsampleLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=(3, 3), stride=(2, 2), padding=1,
                              bias=False)
        self.norm = nn.LayerNorm(c_out, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.conv((x * mask[:, None, :, None]).to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2).contiguous())
        return x, mask[:, ::2]


class SubsampleConvProjection(nn.Module):
    def __init__(self, cfg: Gemma4AudioTowerConfig):
        super().__init__()
        c0, c1 = cfg.subsampling_conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.rms_norm_eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.rms_norm_eps)
        # transformers sizes it (c0 // 4) * c1: the features must have c0 (128) bins
        self.input_proj_linear = Linear((c0 // 4) * c1, cfg.hidden_size)

    def forward(self, audio: list[tuple[torch.Tensor, torch.Tensor]]):
        """Each audio's (features, mask) -> the run's buffer, its layout, each one's mask."""
        parts, masks = [], []
        for features, mask in audio:      # convolutions audio by audio, over its own frames
            x, mask = self.layer0(features[None, None], mask[None])
            x, mask = self.layer1(x, mask)
            parts.append(x.permute(0, 2, 3, 1).reshape(x.shape[2], -1))
            masks.append(mask[0])
        rows = MediaRows.of([x.shape[0] for x in parts])
        return self.input_proj_linear(rows.pack(parts)), rows, masks


class FeedForward(nn.Module):
    def __init__(self, cfg: Gemma4AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.ffw_layer_1 = ClippedLinear(cfg.use_clipped_linears, d, 4 * d)
        self.ffw_layer_2 = ClippedLinear(cfg.use_clipped_linears, 4 * d, d)
        self.pre_layer_norm = RMSNorm(d, 1e-6)
        self.post_layer_norm = RMSNorm(d, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        clip = self.cfg.gradient_clipping
        h = self.pre_layer_norm(_clip(x, clip))
        h = self.ffw_layer_2(F.silu(self.ffw_layer_1(h)))
        h = self.post_layer_norm(_clip(h, clip))
        return h * self.cfg.residual_weight + x


class AudioAttention(nn.Module):
    """Chunked local attention: each chunk of ``attention_chunk_size`` queries reads its
    context (``attention_context_left - 1`` frames back), with a relative position term."""

    def __init__(self, cfg: Gemma4AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_heads
        self.heads, self.head_dim = h, d // h
        self.chunk = cfg.attention_chunk_size
        self.past = cfg.attention_context_left - 1
        self.future = cfg.attention_context_right
        self.context = self.chunk + self.past + self.future
        clipped = cfg.use_clipped_linears
        self.q_proj = ClippedLinear(clipped, d, d)
        self.k_proj = ClippedLinear(clipped, d, d)
        self.v_proj = ClippedLinear(clipped, d, d)
        self.post = ClippedLinear(clipped, d, d)
        self.relative_k_proj = Linear(d, d)
        self.per_dim_scale = nn.Parameter(torch.empty(self.head_dim))

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        n = -(-t // self.chunk)
        return F.pad(x, (0, 0, 0, 0, 0, n * self.chunk - t)).reshape(
            n, self.chunk, self.heads, self.head_dim)

    def _context(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (0, 0, 0, 0, self.past, self.future + self.chunk - 1))
        return torch.movedim(x.unfold(0, self.context, self.chunk), -1, 1)   # [n, ctx, H, D]

    def _rel_shift(self, x: torch.Tensor) -> torch.Tensor:
        h, n, b, p = x.shape
        x = F.pad(x, (0, self.context + 1 - p)).view(h, n, b * (self.context + 1))
        return x[..., :b * self.context].view(h, n, b, self.context)

    def forward(self, x: torch.Tensor, rows: MediaRows, rel: torch.Tensor,
                blocked: list[torch.Tensor]) -> torch.Tensor:
        """``x``: a tower run's buffer; attention audio by audio over its own frames."""
        q_all, k_all, v_all = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        rel_k = self.relative_k_proj(tile_rows(rel))[:rel.shape[0]]
        rel_k = rel_k.view(-1, self.heads, self.head_dim).float()
        out = torch.zeros_like(x)
        for (s, e), mask in zip(rows.spans(), blocked, strict=True):
            out[s:e] = self._attend(q_all[s:e], k_all[s:e], v_all[s:e], rel_k, mask)
        return self.post(out)

    def _attend(self, q, k, v, rel_k, blocked_mask) -> torch.Tensor:
        t, hd, heads, dtype = q.shape[0], self.head_dim, self.heads, q.dtype
        q, k, v = (a.float().view(t, heads, hd) for a in (q, k, v))
        q = q * ((hd ** -0.5) / math.log(2)) * F.softplus(self.per_dim_scale)
        k = k * (math.log(1 + math.e) / math.log(2))
        qb = self._blocks(q)                     # [n, chunk, H, D]
        kb, vb = self._context(k), self._context(v)
        n = qb.shape[0]
        queries = qb.permute(2, 0, 1, 3)        # [H, n, chunk, D]
        ac = queries @ kb.permute(2, 0, 3, 1)   # [H, n, chunk, ctx]
        bd = queries.reshape(heads, -1, hd) @ rel_k.permute(1, 2, 0)
        bd = self._rel_shift(bd.reshape(heads, n, self.chunk, -1))
        cap = self.cfg.attention_logit_cap
        logits = torch.tanh((ac + bd) / cap) * cap
        logits = logits.masked_fill(~blocked_mask[None], self.cfg.attention_invalid_logits_value)
        weights = F.softmax(logits, dim=-1, dtype=torch.float32)
        out = weights @ vb.permute(2, 0, 1, 3)   # [H, n, chunk, D]
        return out.permute(1, 2, 0, 3).reshape(n * self.chunk, -1)[:t].to(dtype)


class LightConv(nn.Module):
    def __init__(self, cfg: Gemma4AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.linear_start = ClippedLinear(cfg.use_clipped_linears, d, 2 * d)
        self.linear_end = ClippedLinear(cfg.use_clipped_linears, d, d)
        self.depthwise_conv1d = nn.Conv1d(d, d, cfg.conv_kernel_size, groups=d, bias=False)
        self.pre_layer_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.conv_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rows: MediaRows) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        conv = torch.zeros_like(h)
        for s, e in rows.spans():      # audio by audio, over its own frames
            part = F.pad(h[s:e].t()[None], (self.cfg.conv_kernel_size - 1, 0))     # causal
            conv[s:e] = self.depthwise_conv1d(part)[0].t()
        h = self.conv_norm(_clip(conv, self.cfg.gradient_clipping))
        return self.linear_end(F.silu(h)) + x


class AudioLayer(nn.Module):
    def __init__(self, cfg: Gemma4AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.feed_forward1 = FeedForward(cfg)
        self.feed_forward2 = FeedForward(cfg)
        self.self_attn = AudioAttention(cfg)
        self.lconv1d = LightConv(cfg)
        self.norm_pre_attn = RMSNorm(d, 1e-6)
        self.norm_post_attn = RMSNorm(d, 1e-6)
        self.norm_out = RMSNorm(d, 1e-6)

    def forward(self, x, rows, rel, blocked):
        clip = self.cfg.gradient_clipping
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(_clip(x, clip)), rows, rel, blocked)
        x = self.norm_post_attn(_clip(h, clip)) + x
        x = self.feed_forward2(self.lconv1d(x, rows))
        return self.norm_out(_clip(x, clip))


class Gemma4AudioTower(nn.Module):
    def __init__(self, cfg: Gemma4AudioTowerConfig):
        super().__init__()
        self.cfg = cfg
        self.subsample_conv_projection = SubsampleConvProjection(cfg)
        self.layers = nn.ModuleList(AudioLayer(cfg) for _ in range(cfg.num_layers))
        self.output_proj = Linear(cfg.hidden_size, cfg.output_proj_dims, bias=True)

    def _rel_embeddings(self, dtype, device) -> torch.Tensor:
        cfg = self.cfg
        context = cfg.attention_chunk_size + cfg.attention_context_left - 1 \
            + cfg.attention_context_right
        timescales = cfg.hidden_size // 2
        step = math.log(10000.0) / max(timescales - 1, 1)
        inv = torch.exp(torch.arange(timescales, device=device) * -step)[None]
        pos = torch.arange(context // 2, -1, -1, device=device)[:, None]
        scaled = pos * inv
        return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=-1).to(dtype)

    def _blocked_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """[blocks, chunk, context] bool: query reads key (the key is real, at most
        ``context_left - 1`` frames back, ``context_right`` ahead)."""
        cfg = self.cfg
        chunk, past, future = (cfg.attention_chunk_size, cfg.attention_context_left - 1,
                               cfg.attention_context_right)
        t = valid.shape[0]
        n = -(-t // chunk)
        q = torch.arange(n * chunk, device=valid.device).view(n, chunk, 1)
        k = (torch.arange(n, device=valid.device) * chunk)[:, None, None] - past \
            + torch.arange(chunk + past + future, device=valid.device)[None, None, :]
        dist = q - k
        inside = (k >= 0) & (k < t) & (q < t)
        real = valid[k.clamp(0, t - 1)] & inside
        return real & (((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < future)))

    def forward(self, audio: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Each audio's [frames, feature_size] log-mel and its mask -> [tokens,
        output_proj_dims], the rows its real frames reach; every audio's rows in one buffer
        (models/media_rows.py)."""
        x, rows, valid = self.subsample_conv_projection(audio)
        rel = self._rel_embeddings(x.dtype, x.device)
        blocked = [self._blocked_mask(v) for v in valid]
        for layer in self.layers:
            x = layer(x, rows, rel, blocked)
        x = self.output_proj(x)
        return [part[v] for part, v in zip(rows.unpack(x), valid, strict=True)]


class AudioEmbedder(nn.Module):
    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.eps = eps
        self.embedding_projection = Linear(d_in, d_out)

    def forward(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each audio's ``[tokens, d_in]`` -> ``[tokens, d_out]``, all in one buffer."""
        rows = MediaRows.of([x.shape[0] for x in parts])
        return rows.unpack(self.embedding_projection(_unit_rms(rows.pack(parts), self.eps)))
