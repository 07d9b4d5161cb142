"""The engine: requests in, scores out.

request -> Prepared (prepare: parse, packs, query-set layout, tokenised content) -> passes
(batch: one call's requests; scheduler: packer + runner) -> ScoreResponse (respond). floor values (the same queries
over empty content) are scored once per (presentation, query, options) in a DocTree of their
own and cached (floors), never per document.
"""

from __future__ import annotations

import gc
import hashlib
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .. import __version__
from ..completions import CompletionRequest, CompletionResponse
from ..errors import SpinfError
from ..models.build import build_model
from ..models.loader import Checkpoint, load_checkpoint
from ..packs import official_packs
from ..protocol import DEFAULT_LIMITS, ScoreRequest, ScoreResponse
from ..quant.fp8_static import load_scales, scales_path
from ..tiles import RowPart
from .batch import ScoringBatch
from .completion import PreparedCompletion, TokenPieces, encode_many
from .decision import code_ids, served_manifest
from .decode import SlotDecoder, SlotJob
from .floors import FloorCache
from .layout import FlatDoc
from .media import MediaLayout
from .merge import root_key
from .prepare import Preparer
from .presentation import Presenter, choose_mode
from .root_cache import RootCache, keepable
from .runner import DocScores, ModelRunner, PendingPass

KERNEL_VERSION = "prefix-tree-fused-6"   # bump when a change moves any score's bits


def cpu_class() -> str:
    """The CPU as the fingerprint names it: its vendor and the vector instructions torch
    dispatches to (e.g. ``cpu AuthenticAMD AVX2``). The BLAS and torch pick other fp32
    kernels on another vendor or ISA, so the same scores come out in other bits."""
    return f"cpu {cpu_vendor()} {torch.backends.cpu.get_cpu_capability()}"


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), else the machine."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine() or "unknown"


@dataclass
class EngineSettings:
    """The engine's settings (``Engine(..., settings=)``, ``Engine.load(..., settings=)``).
    Each field's ``doc`` is its entry in docs/reference/configuration.md."""

    max_pass_tokens: int | None = field(default=None, metadata={
        "doc": "rows of one pass. None: 16384 on CUDA, 8192 on the CPU"})
    # the hosted API's 4,096; a server of one's own may raise it up to the model's context
    max_content_tokens: int = field(default=DEFAULT_LIMITS.max_content_tokens, metadata={
        "doc": "content tokens per input; up to the model's context (a request's own "
               "`limits` may only lower it)"})
    max_combinations: int = field(default=10_000, metadata={
        "doc": "combinations per query (the hosted limit: 10,000 prompts an input)"})
    floor_cache_size: int = field(default=100_000, metadata={
        "doc": "floor values kept in the in-process LRU"})
    root_cache_mib: int = field(default=0, metadata={
        "doc": "MiB of roots' keys and values kept across passes and calls (device memory on "
               "CUDA), so a document sent again reads only its questions' rows, its scores "
               "unchanged; the least recently used go first. 0: off"})
    presentation: str = field(default="auto", metadata={
        "doc": "`auto` | `raw` | `chat`: how content is shown to the model (auto: the chat "
               "template for an instruct model that has one, else the raw text)"})
    scheme: str = field(default="auto", metadata={
        "doc": "`auto` | `fp32` | `bf16` | `fp8` (W8A8, per-token activation scales; GPUs "
               "with fp8 tensor cores, or the CPU's exact reference path) | `fp8-static` "
               "(W8A8, activation scales calibrated offline: `fp8_scales`, or an fp8 "
               "checkpoint's own; CUDA, or the CPU's exact reference path) | `int8` "
               "(weight-only, per-channel scales; CPU or CUDA) | `int4` (a GPTQ checkpoint "
               "kept packed, W4A16; CUDA; auto there for GPTQ). auto serves an fp8 checkpoint "
               "(compressed-tensors) in its own fp8 / fp8-static"})
    fp8_scales: str | None = field(default=None, metadata={
        "doc": "`fp8-static`: the activation scales file (`spinf-serve quantize fp8-static`). "
               "None: an fp8 checkpoint's own stored scales, else "
               "`fp8-static-scales.safetensors` beside the checkpoint"})
    cuda_graphs: bool = field(default=True, metadata={
        "doc": "CUDA: replay passes as captured graphs (engine/cuda_graphs.py)"})
    fuse: bool = field(default=True, metadata={
        "doc": "CUDA: fused projections and forward kernels (off: module by module)"})


def freeze_heap() -> None:
    """For a process that keeps one engine for its life: move everything alive now (the
    model, the libraries) out of the cyclic collector's reach, so that its full collections
    stop walking that heap in the middle of a batch (on the 2-core CPU they paused a
    24-request batch for ~0.3 s now and then)."""
    gc.collect()
    gc.freeze()


class Engine:
    def __init__(self, checkpoint: Checkpoint, device: str | None = None,
                 settings: EngineSettings | None = None, packs: dict | None = None):
        """``checkpoint.weights = None`` builds random weights with the real shapes; ``packs``:
        the prompt packs requests may name (default: the official ones)."""
        self.checkpoint = checkpoint
        self.settings = replace(settings) if settings else EngineSettings()
        self.scales_digest = None
        input_scales = None
        stored_static = getattr(checkpoint.stored_format, "scheme", None) == "fp8-static"
        if self.settings.scheme == "fp8-static" and (self.settings.fp8_scales
                                                     or not stored_static):
            path = scales_path(self.settings.fp8_scales, checkpoint.path)
            input_scales, _ = load_scales(path, checkpoint.weights_digest)
            self.scales_digest = hashlib.sha256(path.read_bytes()).hexdigest()
        built = build_model(checkpoint, device, self.settings.scheme, input_scales)
        self.model, self.config = built.model, built.config
        self.device, self.scheme, self.dtype = built.device, built.scheme, built.dtype
        if self.settings.max_pass_tokens is None:
            self.settings.max_pass_tokens = 16384 if self.device.type == "cuda" else 8192
        self.pad_id = checkpoint.config.get("pad_token_id") or 0
        self.pieces = TokenPieces(checkpoint.tokenizer)   # completions spell tokens by it
        self.runner = ModelRunner(self.model, self.device, self.dtype, self.pad_id,
                                  fuse=self.settings.fuse, cuda_graphs=self.settings.cuda_graphs)
        self.decoder = SlotDecoder(self.model, checkpoint.tokenizer, checkpoint.eos_token_id,
                                   self.pad_id)
        mode = choose_mode(self.settings.presentation, checkpoint.name, checkpoint.chat_template)
        tok = checkpoint.tokenizer
        media = MediaLayout.for_model(self.model, tok)
        self.manifest = served_manifest(checkpoint, media.kinds if media is not None else ())
        decision = self.manifest.decision
        if decision is not None:
            self.model.set_codes(code_ids(decision, tok, self.manifest.id), decision.temperature)
        self.presenter = Presenter(tok, checkpoint.bos_token_id, mode, checkpoint.chat_template,
                                   bos_text=tok.id_to_token(checkpoint.bos_token_id) or "<bos>",
                                   eos_text=tok.id_to_token(checkpoint.eos_token_id) or "<eos>",
                                   frame=decision.prompt.frame_content if decision else None)
        self.packs = official_packs() if packs is None else packs
        limits = self.manifest.limits
        if limits.max_content_tokens is not None:
            self.settings.max_content_tokens = min(self.settings.max_content_tokens,
                                                   limits.max_content_tokens)
        self.preparer = Preparer(self.presenter, self.pad_id, self.packs,
                                 context=min(self.config.max_position_embeddings,
                                             limits.context or self.config.max_position_embeddings),
                                 max_combinations=self.settings.max_combinations,
                                 max_content_tokens=self.settings.max_content_tokens,
                                 model=self.manifest.id, names=self.manifest.names,
                                 media=media, media_kinds=tuple(self.manifest.media),
                                 decision=decision, max_inputs=limits.max_inputs,
                                 capabilities=tuple(self.manifest.capabilities))
        self.floors = FloorCache(self.settings.floor_cache_size)
        # kept roots: not for DeltaNet layers, which carry a state rather than keys and values
        self.roots = (RootCache(self.settings.root_cache_mib << 20)
                      if self.settings.root_cache_mib > 0
                      and not getattr(self.model, "tree_spans", False) else None)
        self.fingerprint = self._fingerprint()

    @classmethod
    def load(cls, model: str | None = None, *, device: str | None = None,
             settings: EngineSettings | None = None, packs: dict | None = None,
             load_format: str = "auto") -> Engine:
        """``load_format="dummy"``: random weights of the model's shapes (models/loader)."""
        return cls(load_checkpoint(model, load_format=load_format), device=device,
                   settings=settings, packs=packs)

    @property
    def model_name(self) -> str:
        """The served name: the manifest's id (by default the name it was loaded by)."""
        return self.manifest.id

    @property
    def device_class(self) -> str:
        """What the fingerprint calls the device: the GPU's name, or ``cpu_class()``."""
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return cpu_class()

    @property
    def media_kinds(self) -> tuple[str, ...]:
        """The media kinds this engine reads in a content (("image", "video") or none): the
        model's, as far as its manifest lists them."""
        return tuple(self.manifest.media)

    def _fingerprint(self) -> str:
        device_class = self.device_class
        fused = self.settings.fuse and self.device.type == "cuda"   # other kernels, other bits
        parts = [self.checkpoint.weights_digest, self.scheme, __version__, KERNEL_VERSION,
                 f"threads={torch.get_num_threads()}", f"fused={fused}",
                 device_class, self.presenter.mode]
        if self.scales_digest:   # fp8-static: other scales, other bits
            parts.append(self.scales_digest)
        return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:10]

    # ---- public API -------------------------------------------------------------------

    def score(self, request: dict | ScoreRequest) -> ScoreResponse:
        result = self.score_batch([request])[0]
        if isinstance(result, SpinfError):
            raise result
        return result

    def complete(self, request: dict | CompletionRequest) -> CompletionResponse:
        """A completions request (completions.py) alone: its prompts' token logprobs and
        greedy tokens."""
        if not isinstance(request, CompletionRequest):
            request = CompletionRequest.parse(request)
        result = self.score_batch([request])[0]
        if isinstance(result, SpinfError):
            raise result
        return result

    def warm_up(self) -> list[int]:
        """Compile every pass size's forward now (CUDA; captured as graphs where they are
        used), not in the passes of the first requests: a service does this before it
        serves, then freezes the heap (``freeze_heap``) with the compilers' objects in it,
        which the cyclic collector's full collections would otherwise walk for good (~0.1 s
        each on a GPU host). Returns the pass sizes, in rows (none on the CPU)."""
        return self.runner.warm_up(self.settings.max_pass_tokens)

    def row_parts(self, request: dict | ScoreRequest | CompletionRequest) -> list[RowPart]:
        """``rows`` per document, with what lets documents of the same content share a
        root in a pass (the queue fills passes by these, as the packer does)."""
        if isinstance(request, CompletionRequest):
            return PreparedCompletion.row_parts(self, request)
        return self.preparer.row_parts(request)

    def row_parts_many(self, requests: Sequence[dict | ScoreRequest | CompletionRequest]
                       ) -> list[list[RowPart] | Exception]:
        """``row_parts`` of each request (an error in place of a request's parts): the
        queue reads a pass's entries at once. Scoring requests are prepared whole, their
        contents tokenised together, and kept for the pass that scores them
        (Preparer.row_parts_many); the prompts of completions are tokenised together too
        (lm-eval sends one request per option)."""
        completions = [r for r in requests if isinstance(r, CompletionRequest)]
        if len(completions) > 1:
            self.encode_completions(completions)
        scoring = iter(self.preparer.row_parts_many(
            [r for r in requests if not isinstance(r, CompletionRequest)],
            self._root_is_kept if self.roots is not None else None))
        out: list[list[RowPart] | Exception] = []
        for request in requests:
            if not isinstance(request, CompletionRequest):
                out.append(next(scoring))
                continue
            try:
                out.append(PreparedCompletion.row_parts(self, request))
            except Exception as err:   # noqa: BLE001 - the request's own, handed back
                out.append(err)
        return out

    def _root_is_kept(self, doc: FlatDoc) -> bool:
        """Whether ``doc``'s root is kept (engine/root_cache.py): a pass then holds its
        branch rows alone."""
        window = self.runner.model.cfg.sliding_window
        return keepable(doc) and root_key(doc, window) in self.roots.roots

    def encode_completions(self, requests: list[CompletionRequest]) -> None:
        """Tokenise the prompts of many completions requests together (in parallel), ahead
        of their ``row_parts``."""
        encode_many(self, requests)

    def rows(self, request: dict | ScoreRequest | CompletionRequest) -> int:
        """Rows the request's document takes in a pass (the real layout: content plus the
        query set's prefix tree, padded to the tile; a completion: its prompts' first
        passes); the queue packs passes by this. Raises what scoring would."""
        if isinstance(request, CompletionRequest):
            return PreparedCompletion.rows(self, request)
        return self.preparer.rows(request)

    def score_batch(self, requests: Sequence[dict | ScoreRequest | CompletionRequest]
                    ) -> list[ScoreResponse | CompletionResponse | SpinfError]:
        """Score many requests packed together; a bad request yields its error in place.
        Every input of every request is one document; passes start while later requests are
        still being laid out (engine/scheduler.py)."""
        return self.start_batch(requests).finish()

    def start_batch(self, requests: Sequence[dict | ScoreRequest | CompletionRequest]
                    ) -> ScoringBatch:
        """``score_batch`` up to its last pass: returns once that pass is queued on the
        device; ``.finish()`` reads it back and answers. Starting the next batch before
        finishing this one keeps the device busy between batches (engine/batch.py)."""
        return ScoringBatch(self, requests).start()

    # ---- passes -----------------------------------------------------------------------

    def _decode_slots(self, pending: PendingPass, scores: list[DocScores]) -> None:
        """Decode every extraction slot of a pass together, from its kept keys and values."""
        keys, jobs = [], []
        for (i, b), first in pending.first.items():
            doc = pending.docs[i]
            _, context, settings = doc.extract[b]
            rows = torch.tensor(context)
            jobs.append(SlotJob(rows + pending.keep_base[i], doc.context_positions(rows),
                                first, **settings))
            keys.append((i, b))
        for (i, b), found in zip(keys, self.decoder.decode(jobs, pending.kept), strict=True):
            scores[i].found[b] = found
