"""Running one Pass through the model and reading out option log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from ..kernels.attention import (
    AttentionPlan,
    BranchTiles,
    DocSpan,
    PromptBlockRows,
    prompt_block_mask,
)
from ..tiles import PROMPT_BLOCK
from . import host_math
from .host_staging import HostStaging, settled
from .layout import FlatDoc
from .pass_plan import cuda_pass_plan, kept_keys, pass_rows
from .root_cache import KeptRoot
from .top_tokens import strict_top

READOUT_CHUNK = 1024  # LM-head rows at a time (a multiple of READOUT_TILE)
PASS_BUCKET = 4096    # CUDA passes are padded to a multiple of this
# Past this many parameters outside the embeddings a pass is compute-bound: its kernel
# launches hide behind the kernels, and a graph (which computes the bucket's padding rows
# too) would cost more than it saves.
GRAPH_MAX_BODY_PARAMS = 2_000_000_000


class ScoreLists(NamedTuple):
    logprobs: list[float]       # per option
    probs: list[float]          # per option, over its branch's options
    branch_start: list[int]     # per branch + 1
    residual: list[float]       # per branch


@dataclass
class DocScores:
    """Per option its summed logprob (fp32), per branch the full-vocab residual."""

    option_logprobs: np.ndarray     # [options] fp32, option after option (FlatDoc order)
    branch_start: np.ndarray        # [branches + 1]: branch b's options are [start[b], start[b+1])
    residual: np.ndarray            # [branches] float64: 1 - sum(exp(logprob))
    found: dict = field(default_factory=dict)   # extraction branch -> decode.Found answers
    # a completion prompt (FlatDoc.echo): per readout the next token's logprob [R] (NaN where
    # none), the top-N logprobs [R, N] and their token ids [R, N]
    echo: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # a floor's branches as responses read them, kept (engine/respond.py): (branch, spelling
    # starts) -> (logprobs, probabilities, residual)
    reads: dict = field(default_factory=dict, repr=False, compare=False)
    # option_probs, when the pass worked it out for all its documents at once (finish)
    probs: np.ndarray | None = field(default=None, repr=False, compare=False)

    def branch(self, b: int) -> np.ndarray:
        return self.option_logprobs[self.branch_start[b]:self.branch_start[b + 1]]

    @cached_property
    def lists(self) -> ScoreLists:
        """The scores as Python lists, converted once (a response reads them option by
        option)."""
        return ScoreLists(self.option_logprobs.tolist(), self.option_probs.tolist(),
                          self.branch_start.tolist(), self.residual.tolist())

    @cached_property
    def option_probs(self) -> np.ndarray:
        """Each option's probability renormalised over its branch's options (float64)."""
        if self.probs is not None:
            return self.probs
        owner = np.repeat(np.arange(len(self.residual)), np.diff(self.branch_start))
        return renormalised(self.option_logprobs, owner, len(self.residual))

    @property
    def logprobs(self) -> list[torch.Tensor]:
        """Per branch, its options' logprobs."""
        return [torch.from_numpy(self.branch(b)) for b in range(len(self.residual))]


class EchoRows:
    """The readouts of a pass's completion prompts that ask for the same top-N: per readout
    row, the logprob of the token after it and the row's top-N, computed for the span of rows
    from the first such prompt's first readout to the last one's last, a LM-head chunk at a
    time (rows between them, of other documents or padding, are computed and never read:
    a span is a view of the chunk's log-softmax and one launch per step, where a launch per
    prompt cost the host more than the rows). Each row's figures come from its own fp32
    log-softmax row alone."""

    def __init__(self, docs: list[tuple[int, int, int]], top: int, next_ids: torch.Tensor):
        self.docs = docs                        # (document, first readout, readouts)
        self.lo = docs[0][1]                    # the span's first readout in the pass
        self.next_ids = next_ids                # [span] -1: none (or not a prompt)
        n, device = next_ids.shape[0], next_ids.device
        self.token_lp = torch.empty(n, dtype=torch.float32, device=device)
        self.top_lp = torch.empty(n, top, dtype=torch.float32, device=device)
        self.top_ids = torch.empty(n, top, dtype=torch.int64, device=device)

    def read(self, logprobs: torch.Tensor, lo: int, hi: int) -> None:
        """The span's rows among readouts ``lo..hi - 1`` (``logprobs``' rows)."""
        a, z = max(lo, self.lo), min(hi, self.lo + self.next_ids.shape[0])
        if a >= z:
            return
        part = logprobs[a - lo:z - lo]
        at = slice(a - self.lo, z - self.lo)
        ids = self.next_ids[at]
        picked = part.gather(1, ids.clamp(min=0)[:, None])[:, 0]
        self.token_lp[at] = torch.where(ids >= 0, picked, torch.full_like(picked, float("nan")))
        self.top_lp[at], self.top_ids[at] = strict_top(part, self.top_lp.shape[1])

    def to_host(self) -> None:
        self.token_lp, self.top_lp, self.top_ids = (
            t.to("cpu", non_blocking=True) for t in (self.token_lp, self.top_lp, self.top_ids))

    def of(self, at: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The figures of the prompt whose readouts are ``at..at + count - 1``."""
        at -= self.lo
        return tuple(t[at:at + count] for t in (self.token_lp, self.top_lp, self.top_ids))


@dataclass
class PendingPass:
    """A pass queued on the device: its summands, sorted by readout row, not yet read back."""

    docs: list[FlatDoc]
    values: torch.Tensor       # fp32, in readout order; on CUDA a host copy, valid once wait()
    order: torch.Tensor        # values[k] belongs to summand order[k] (document order)
    # Extraction slots: (doc index, branch) -> full-vocab logprobs after the template, and
    # the kept keys/values of the documents that have slots (rows from keep_base[doc]).
    first: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    keep_base: dict[int, int] = field(default_factory=dict)
    # completion prompts: doc index -> (next-token logprobs, top-N logprobs, top-N ids), on
    # the host as ``values``
    echo: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)
    # CUDA: events recorded before the pass's first kernel and after its last one
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    # the roots kept from this pass (launch's keep_roots): doc index -> its KeptRoot
    kept_roots: dict[int, KeptRoot] = field(default_factory=dict)

    def wait(self) -> None:
        """Block until the pass has run on the device (the interpreter lock released
        meanwhile, so another thread may wait here while the engine thread lays out the
        next pass); at once on the CPU, where launching a pass runs it."""
        if self.events is not None:
            settled(self.events[1])

    def device_seconds(self) -> float | None:
        """The device's time on the pass, from the stream reaching it to its last kernel
        (None on the CPU); once it has run."""
        if self.events is None:
            return None
        return self.events[0].elapsed_time(self.events[1]) / 1000


class ModelRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 pad_id: int, *, fuse: bool = True, cuda_graphs: bool = True):
        """``fuse``: on CUDA, run the model's fused forward where it has one (``fusable``).
        ``cuda_graphs``: on CUDA, replay each pass bucket's forward as a captured graph
        (models whose forward is capturable, up to GRAPH_MAX_BODY_PARAMS; passes without
        extraction slots)."""
        self.model, self.device, self.dtype, self.pad_id = model, device, dtype, pad_id
        self.unread = 0     # passes launched and not read back yet
        model.use_fused = fuse and device.type == "cuda" and model.fusable
        # a pass's rows and readout indices go up through buffers pinned once
        self.staging = HostStaging(device) if device.type == "cuda" else None
        self.graphs = None
        if (cuda_graphs and device.type == "cuda" and getattr(model, "capturable", False)
                and _body_params(model) <= GRAPH_MAX_BODY_PARAMS):
            from .cuda_graphs import PassGraphs

            self.graphs = PassGraphs(model, self.staging)

    @torch.inference_mode()
    def warm_up(self, max_rows: int) -> list[int]:
        """CUDA: compile (and capture, with graphs) the forward of every pass size up to
        ``max_rows`` now, each on a pass of padding rows, rather than in the first passes
        that carry requests. Returns the sizes (none on the CPU: nothing to compile; none
        for a model whose layers walk each document's spans, as the DeltaNet layers do: a
        pass without documents is not theirs to run)."""
        if self.device.type != "cuda" or getattr(self.model, "tree_spans", False):
            return []
        sizes = list(range(PASS_BUCKET, -(-max_rows // PASS_BUCKET) * PASS_BUCKET + 1,
                           PASS_BUCKET))
        for rows in sizes:
            if self.graphs is not None:
                self.graphs.graph(rows)
                continue
            inputs = self._stage(pass_rows([], rows, self.pad_id))
            self.model(inputs[0].long(), inputs[1].long(), cuda_pass_plan(self.model, inputs))
        torch.cuda.synchronize(self.device)
        return sizes

    def starts_at_once(self) -> bool:
        """Whether a pass launched now starts on an idle device for the host's cost of one
        graph launch: passes replayed as graphs, every pass launched read back. Not on the
        CPU (launching a pass runs it), nor eagerly: an eager pass's launch is host work of
        its own, and a small model's job launched early that way measured slower."""
        return self.graphs is not None and self.unread == 0

    def flex_plan(self, docs: list[FlatDoc], rows: int):
        """CUDA: the pass's tree tensors on the device -> block masks."""
        inputs = self._stage(pass_rows(docs, rows, self.pad_id))
        return cuda_pass_plan(self.model, inputs).flex

    def _stage(self, array: np.ndarray) -> torch.Tensor:
        """A pass's rows or readout indices on the device (through the pinned ring: the
        next pass is laid out while this one runs); as they are on the CPU."""
        if self.staging is None:
            return torch.from_numpy(array)
        return self.staging.upload(array)

    def _upload(self, t: torch.Tensor) -> torch.Tensor:
        """Host -> device without waiting for the work already queued on the device (a copy
        from pageable memory would), so the next pass is laid out while this one runs."""
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _upload_media(self, payload):
        """A medium's pixels (or an audio's features and mask) on the device, queued like the
        pass's rows."""
        if isinstance(payload, tuple):
            return tuple(self._upload(p) if isinstance(p, torch.Tensor) else p
                         for p in payload)
        return self._upload(payload)

    def run(self, docs: list[FlatDoc]) -> list[DocScores]:
        """Run the documents as one packed pass."""
        return self.finish(self.launch(docs))

    @torch.inference_mode()
    def launch(self, docs: list[FlatDoc], keep_roots: list[int] = ()) -> PendingPass:
        """Queue a pass on the device and return at once: nothing here waits for the device,
        so the caller can lay out the next pass while this one runs. ``keep_roots``: the
        documents whose roots' keys and values come back (``PendingPass.kept_roots``)."""
        starts, start = [], 0
        for doc in docs:
            starts.append(start)
            start += doc.length
        keep, keep_base, kept_rows = [], {}, 0
        # per document with extraction slots: its kept root (or None) and its rows' count
        kept_parts: list[tuple[KeptRoot | None, int]] = []
        for i, (doc, at) in enumerate(zip(docs, starts, strict=True)):
            if doc.extract:
                keep_base[i] = kept_rows
                keep.append(torch.arange(at, at + doc.tokens))
                kept_parts.append((doc.kept_root, doc.tokens))
                kept_rows += doc.tokens + (doc.kept_root.rows if doc.kept_root else 0)
        if self.device.type == "cuda":
            # A few fixed pass sizes, so compiled kernels and captured graphs are reused.
            rows = -(-start // PASS_BUCKET) * PASS_BUCKET
            rows_array = pass_rows(docs, rows, self.pad_id)
            # the pass's device time counts from its first queued operation: on an idle
            # device an event recorded before the rows were built would count their host time
            began = torch.cuda.Event(enable_timing=True)
            began.record()
            media = any(doc.media for doc in docs)
            kept = kept_keys(docs, starts, self.device)
            # a pass with media runs eagerly: its towers and their features are not captured;
            # so does one that keeps roots or reads kept ones (their keys are not the graph's)
            if (self.graphs is not None and not keep and not keep_roots and not media
                    and kept is None):
                hidden = self.graphs.run(rows_array)
                return self._readouts(docs, starts, hidden, began)
            inputs = self._stage(rows_array)
            ids, pos = inputs[0].long(), inputs[1].long()
            plan = cuda_pass_plan(self.model, inputs, real_rows=start, kept=kept)
            if media:
                plan.media = [(s + image.start, self._upload_media(image.pixels), image.kind)
                              for d, s in zip(docs, starts, strict=True) for image in d.media]
            if getattr(self.model, "tree_spans", False):
                # the DeltaNet layers walk each document's root and branch paths
                plan.docs = [doc_span(d, s, self.model.cfg.sliding_window, self.device)
                             for d, s in zip(docs, starts, strict=True)]
        else:
            began = None
            ids = torch.cat([d.input_ids for d in docs])
            pos = torch.cat([d.positions for d in docs])
            window = self.model.cfg.sliding_window
            both_ways = getattr(self.model, "media_attention", "all")
            plan = AttentionPlan([doc_span(d, s, window, self.device, both_ways)
                                  for d, s in zip(docs, starts, strict=True)])
            plan.media = [(s + image.start, image.pixels, image.kind)
                          for d, s in zip(docs, starts, strict=True) for image in d.media]
        if keep:
            plan.keep_rows = self._upload(torch.cat(keep))
        plan.keep_roots = [(starts[i], starts[i] + docs[i].root) for i in keep_roots]
        hidden = self.model(ids, pos, plan)
        pending = self._readouts(docs, starts, hidden, began)
        pending.kept, pending.keep_base = _with_kept_roots(plan.kept, kept_parts), keep_base
        pending.kept_roots = {i: KeptRoot(layers, docs[i].root)
                              for i, layers in zip(keep_roots, plan.kept_roots or (),
                                                   strict=True)}
        return pending

    def _readouts(self, docs: list[FlatDoc], starts: list[int], hidden: torch.Tensor,
                  began: torch.cuda.Event | None) -> PendingPass:
        """LM head on every document's readout rows (each document's block padded to the
        readout tile), and the (readout, token) summands gathered on the device. Summands are
        sorted by readout row so each LM-head chunk fills one slice: no data-dependent
        indexing, no host sync. ``began``: CUDA, the event recorded before the pass's first
        kernel."""
        # each document's readouts numbered after the previous documents'
        reads = [doc.readout_rows.shape[0] for doc in docs]
        bases = np.cumsum([0, *reads])
        base = int(bases[-1])
        first_at: dict[int, tuple[int, int]] = {}   # readout index -> (doc, branch)
        echo_at: list[tuple[int, int, int]] = []     # (doc, first readout index, readouts)
        for i, doc in enumerate(docs):
            for b, (r, *_) in doc.extract.items():
                first_at[int(bases[i]) + r] = (i, b)
            if doc.echo is not None:
                echo_at.append((i, int(bases[i]), len(doc.echo.next_ids)))
        # the indices worked out in numpy (a small torch op costs several times a numpy one)
        rows = (np.concatenate([doc.readout_rows.numpy() for doc in docs])
                + np.repeat(np.asarray(starts, dtype=np.int64), reads))
        readout = (np.concatenate([doc.block.term_readout for doc in docs])
                   + np.repeat(bases[:-1], [len(doc.block.term_readout) for doc in docs]))
        order = np.argsort(readout, kind="stable")
        readout_sorted = readout[order]
        bounds = np.searchsorted(readout_sorted,
                                 np.arange(0, base + READOUT_CHUNK, READOUT_CHUNK)).tolist()
        n_terms = len(readout)
        tokens = np.concatenate([doc.block.term_token for doc in docs])[order]
        index_d = self._stage(np.concatenate([rows, readout_sorted, tokens]))
        rows_d, readout_d, token_d = index_d.split([base, n_terms, n_terms])
        values = torch.empty(n_terms, dtype=torch.float32, device=self.device)
        first = {}
        echoes = self._echo_readouts(docs, echo_at)
        for c, lo in enumerate(range(0, base, READOUT_CHUNK)):
            a, b = bounds[c], bounds[c + 1]
            hi = lo + READOUT_CHUNK
            logprobs = self.model.readout_logprobs(hidden[rows_d[lo:hi]])
            values[a:b] = logprobs[readout_d[a:b] - lo, token_d[a:b]]
            for r, key in first_at.items():
                if lo <= r < hi:
                    first[key] = logprobs[r - lo].clone()
            for echo in echoes:
                echo.read(logprobs, lo, hi)
        events = None
        if began is not None:
            # the figures the host reads, copied to it now, behind this pass's kernels: its
            # read-back then waits for this pass alone, not for the passes launched after it
            # (a copy queued at read-back time would run after those, on the one stream)
            values = values.to("cpu", non_blocking=True)
            for echo in echoes:
                echo.to_host()
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            events = (began, ended)
        echo_parts = {i: echo.of(at, count) for echo in echoes for i, at, count in echo.docs}
        self.unread += 1
        return PendingPass(docs, values, torch.from_numpy(order), first, echo=echo_parts,
                           events=events)

    def _echo_readouts(self, docs: list[FlatDoc], echo_at: list[tuple[int, int, int]]
                       ) -> list[EchoRows]:
        """The pass's completion prompts' readouts, one EchoRows per top-N asked."""
        by_top: dict[int, list[tuple[int, int, int]]] = {}
        for i, at, count in echo_at:
            by_top.setdefault(docs[i].echo.top, []).append((i, at, count))
        out = []
        for top, members in by_top.items():
            lo, (_, last, count) = members[0][1], members[-1]
            next_ids = np.full(last + count - lo, -1, dtype=np.int64)
            for i, at, count in members:
                next_ids[at - lo:at - lo + count] = docs[i].echo.next_ids
            out.append(EchoRows(members, top, self._upload(torch.from_numpy(next_ids))))
        return out

    def finish(self, pending: PendingPass) -> list[DocScores]:
        """Wait for the pass and turn its summands into per-option logprobs."""
        pending.wait()     # its figures' copies to the host are done
        self.unread -= 1
        values = np.empty(pending.values.shape[0], dtype=np.float32)
        values[pending.order.numpy()] = pending.values.numpy()
        blocks = [doc.block for doc in pending.docs]
        # every document's options and branches numbered after the previous documents'
        terms = [len(b.term_option) for b in blocks]
        options = np.cumsum([0, *(len(b.option_branch) for b in blocks)])
        branches = np.cumsum([0, *(b.n_branches for b in blocks)])
        term_option = (np.concatenate([b.term_option for b in blocks])
                       + np.repeat(options[:-1], terms))
        option_branch = (np.concatenate([b.option_branch for b in blocks])
                         + np.repeat(branches[:-1], np.diff(options)))
        # Summands added one by one in option order (np.add.at is unbuffered), so an
        # option's sum never depends on the other documents of the pass.
        lp = np.zeros(options[-1], dtype=np.float32)
        np.add.at(lp, term_option, values)
        mass = np.zeros(branches[-1], dtype=np.float64)
        np.add.at(mass, option_branch, host_math.exp(lp))
        residual = 1.0 - mass
        probs = renormalised(lp, option_branch, branches[-1])
        out = [DocScores(lp[options[k]:options[k + 1]], b.option_start,
                         residual[branches[k]:branches[k + 1]],
                         probs=probs[options[k]:options[k + 1]])
               for k, b in enumerate(blocks)]
        for i, parts in pending.echo.items():
            out[i].echo = tuple(part.numpy() for part in parts)
        return out


def _with_kept_roots(kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None,
                     parts: list[tuple[KeptRoot | None, int]]
                     ) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """The kept keys and values of the documents with extraction slots, each document's
    kept root's (if it has one) before its rows in the pass: what their slots' contexts
    index (FlatDoc.extract)."""
    if kept is None or all(root is None for root, _ in parts):
        return kept
    out = {}
    for layer, (k, v) in kept.items():
        keys, values, at = [], [], 0
        for root, rows in parts:
            if root is not None:
                keys.append(root.layers[layer][0])
                values.append(root.layers[layer][1])
            keys.append(k[at:at + rows])
            values.append(v[at:at + rows])
            at += rows
        out[layer] = (torch.cat(keys), torch.cat(values))
    return out


def renormalised(logprobs: np.ndarray, owner: np.ndarray, branches: int) -> np.ndarray:
    """Each option's probability over its branch's options (float64; option k belongs to
    branch owner[k]). Every branch's figures are its own options' alone, so those of a
    document are the same worked out with the other documents of its pass."""
    lp = logprobs.astype(np.float64)
    top = np.full(branches, -np.inf)
    np.maximum.at(top, owner, lp)
    weights = host_math.exp(lp - top[owner])
    total = np.zeros(branches)
    np.add.at(total, owner, weights)
    return weights / total[owner]


def doc_span(doc: FlatDoc, start: int, window: int, dev: torch.device,
             media_attention: str = "all") -> DocSpan:
    """CPU attention metadata of one document placed at ``start``. ``media_attention``: the
    layers on which one image's soft tokens see each other both ways ("all": Gemma 3,
    "sliding": the sliding-window layers only, "none": the text stays causal; Gemma 4)."""
    span = DocSpan(start, doc.root, doc.tokens)
    windowed = doc.max_position >= window
    if doc.kept_root is not None:
        # a kept root (engine/root_cache.py): its branch rows alone, seeing it as they would
        # see the root's rows in the pass
        span.kept = doc.kept_root
        span.branches = _branch_tiles(doc, doc.block.path_buckets,
                                      torch.arange(doc.kept_root.rows),
                                      window if windowed else None, dev)
        return span
    if doc.prompts is not None:
        # a block's shapes and masks follow from its depth alone (its path's length)
        span.blocks = []
        paths = doc.prompts.paths
        for b, path in enumerate(paths):
            keys = len(path)
            span.blocks.append(PromptBlockRows(
                b * PROMPT_BLOCK, torch.from_numpy(path).to(dev),
                prompt_block_mask(keys, PROMPT_BLOCK, None).to(dev),
                prompt_block_mask(keys, PROMPT_BLOCK, window).to(dev)))
        # the tails under each anchor: branch rows whose root is the anchor's path
        for anchor, members in doc.prompts.tail_groups:
            anchor_path = torch.from_numpy(paths[anchor] if anchor >= 0
                                           else np.zeros(0, dtype=np.int64))
            span.tails.append((anchor_path.to(dev), _branch_tiles(
                doc, doc.block.buckets(members), doc.positions[anchor_path],
                window if windowed else None, dev)))
        return span
    root_pos = torch.arange(doc.root)
    both_ways = bool(doc.media) and media_attention != "none"
    # [root, root]: built only for a mask that needs it (plain causal roots run without one)
    seen = root_pos[:, None] >= root_pos[None, :] if both_ways or windowed else None
    if both_ways:
        # an image's soft tokens see each other both ways (transformers' rule)
        image = torch.full((doc.root,), -1)
        for k, rows in enumerate(doc.media):
            if rows.kind == "image":    # audio tokens stay causal
                image[rows.start:rows.end] = k
        seen = seen | ((image[:, None] == image[None, :]) & (image[:, None] >= 0))
        if media_attention == "all":
            span.root_mask = seen.to(dev)
        elif not windowed:    # the sliding layers read root_mask when no window cuts
            span.root_window = seen.to(dev)
    if windowed:
        span.root_window = (seen & (root_pos[:, None] - root_pos[None, :] < window)).to(dev)
    span.branches = _branch_tiles(doc, doc.block.path_buckets, root_pos,
                                  window if windowed else None, dev)
    return span


def _branch_tiles(doc: FlatDoc, buckets: list, root_pos: torch.Tensor, window: int | None,
                  dev: torch.device) -> list[BranchTiles]:
    """Branch rows of ``buckets`` (layout.PathBucket) that see a root at ``root_pos``, with
    their sliding-window masks where ``window`` cuts the document."""
    out = []
    for bucket in buckets:
        rows = torch.from_numpy(bucket.rows)
        path = torch.from_numpy(bucket.path) + doc.root
        ok = torch.from_numpy(bucket.ok)
        tiles = BranchTiles(rows.to(dev), bucket.real, path.to(dev), ok.to(dev))
        if window is not None:
            branch_pos = doc.positions[doc.root + rows]
            tiles.root_window = (branch_pos[:, None] - root_pos[None, :] < window).to(dev)
            tiles.path_window = (ok & (branch_pos[:, None] - doc.positions[path] < window)
                                 ).to(dev)
        out.append(tiles)
    return out


def _body_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
