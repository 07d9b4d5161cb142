"""Documents in, scores out, with the device kept busy.

A pass is launched as soon as enough documents wait to fill it (first-fit over the waiting
ones), or half of it while the device is idle (a batch's first pass, on CUDA with graphs:
the device starts while the host lays out the rest), not when the whole batch has been laid
out, and pass N+1 is queued before pass N is read back: laying out later documents and
answering earlier ones overlap the device. Which documents share a pass never changes a
score (batch invariance), so packing as they come is free to do. Documents of a pass that
share a root run as one (engine/merge.py), and a document whose root an earlier pass read
runs as its branch rows alone on that root's kept keys and values (engine/root_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator

from ..tiles import PassRows
from .layout import FlatDoc
from .merge import Part, PromptPart, merge, root_key, split
from .packer import pack
from .root_cache import RootCache, keepable
from .runner import DocScores, ModelRunner, PendingPass

# per document a pass runs: the (tag, part) of each document merged into it (engine/merge.py)
Members = list[list[tuple[Hashable, Part | PromptPart | None]]]
FILL_SLACK = 1.25   # wait for this many passes' worth of rows, so first-fit has a choice
# ... unless the device is idle (and replays graphs: runner.starts_at_once): then a pass goes
# as soon as this share of one waits, so the device starts on the first documents while the
# host lays out the rest of the batch
IDLE_FILL = 0.5


class PassScheduler:
    def __init__(self, runner: ModelRunner, max_pass_tokens: int,
                 after_pass: Callable[[PendingPass, list[DocScores]], None] | None = None,
                 roots: RootCache | None = None):
        """``after_pass``: called on each pass read back (decoding its extraction slots).
        ``roots``: the roots kept across passes (None: every pass reads its roots)."""
        self.runner, self.max_pass_tokens, self.after_pass = runner, max_pass_tokens, after_pass
        self.roots = roots
        self.window = runner.model.cfg.sliding_window
        self.waiting: list[tuple[Hashable, FlatDoc, Hashable | None]] = []   # + root key
        # the rows the waiting documents take merged (documents sharing a root once): a
        # pass's worth of prompts of one context is far fewer rows than their own lengths
        self.waiting_rows = PassRows()
        self.in_flight: tuple[Members, PendingPass] | None = None
        self.device_s: float | None = None   # the device's time on the passes read back (CUDA)
        self.passes = 0                      # passes launched

    def add(self, tag: Hashable, doc: FlatDoc) -> list[tuple[Hashable, DocScores]]:
        """Queue a document; returns the (tag, scores) of the documents finished meanwhile."""
        self.hold(tag, doc)
        if (self.waiting_rows.rows >= self.max_pass_tokens * IDLE_FILL
                and self.runner.starts_at_once()):
            return [done for batch in self._launch(keep_last=False) for done in batch]
        if self.waiting_rows.rows < self.max_pass_tokens * FILL_SLACK:
            return []
        return [done for batch in self._launch(keep_last=True) for done in batch]

    def hold(self, tag: Hashable, doc: FlatDoc) -> None:
        """Queue a document without launching anything (the next ``flush`` runs it)."""
        key = root_key(doc, self.window)
        if self.roots is not None and key is not None and keepable(doc):
            kept = self.roots.get(key)
            if kept is not None:
                # its branch rows alone; merged only with others on the same kept root
                doc, key = doc.block.place_on_kept(kept, self.runner.pad_id), ("kept", key)
        self.waiting.append((tag, doc, key))
        self.waiting_rows.add(doc, key)

    def flush(self) -> Iterator[list[tuple[Hashable, DocScores]]]:
        """Run everything still waiting; yields the documents not returned before, pass by
        pass, so the caller answers one pass's documents while the device runs the next."""
        yield from self.launch_waiting()
        if self.in_flight is not None:
            yield self.collect()

    def launch_waiting(self) -> Iterator[list[tuple[Hashable, DocScores]]]:
        """``flush`` but the last pass: launch every waiting document, yielding each pass
        read back meanwhile; the last one launched stays in flight (``collect``)."""
        return self._launch(keep_last=False)

    def collect(self) -> list[tuple[Hashable, DocScores]]:
        """Wait for the pass in flight, if any, and return its documents."""
        if self.in_flight is None:
            return []
        job, self.in_flight = self.in_flight, None
        return self._collect(job)

    def _launch(self, *, keep_last: bool) -> Iterator[list[tuple[Hashable, DocScores]]]:
        """Launch the packed passes of the waiting documents (all but the last, least full
        one when more documents may come); yields each pass read back meanwhile."""
        passes = pack([doc for _, doc, _ in self.waiting], self.max_pass_tokens,
                      [key for *_, key in self.waiting])
        held = passes[-1:] if keep_last else []
        launched = passes[:len(passes) - len(held)]
        jobs = [[self.waiting[i] for i in p.docs] for p in launched]
        self.waiting = [self.waiting[i] for p in held for i in p.docs]
        self.waiting_rows = PassRows()
        for _, doc, key in self.waiting:
            self.waiting_rows.add(doc, key)
        for docs in jobs:
            merged = merge([doc for _, doc, _ in docs], [key for *_, key in docs],
                           self.runner.pad_id)
            members = [[(docs[i][0], part) for i, part in parts] for _, parts in merged]
            keys = [docs[parts[0][0]][2] for _, parts in merged]
            keep = self._roots_to_keep([flat for flat, _ in merged], keys)
            pending = self.runner.launch([flat for flat, _ in merged], keep)
            for i in keep:
                self.roots.put(keys[i], pending.kept_roots[i])
            job = (members, pending)
            self.passes += 1
            previous, self.in_flight = self.in_flight, job
            if previous is not None:
                yield self._collect(previous)

    def _roots_to_keep(self, flats: list[FlatDoc], keys: list[Hashable | None]) -> list[int]:
        """The documents of a pass whose roots are to be kept: those that may be and are not
        yet."""
        if self.roots is None:
            return []
        return [i for i, (flat, key) in enumerate(zip(flats, keys, strict=True))
                if key is not None and flat.kept_root is None and key not in self.roots.roots
                and keepable(flat)]

    def _collect(self, job: tuple[Members, PendingPass]) -> list[tuple[Hashable, DocScores]]:
        members, pending = job
        scores = self.runner.finish(pending)
        if (seconds := pending.device_seconds()) is not None:
            self.device_s = (self.device_s or 0.0) + seconds
        if pending.first and self.after_pass is not None:
            self.after_pass(pending, scores)
        return [(tag, split(doc_scores, part))
                for parts, doc_scores in zip(members, scores, strict=True)
                for tag, part in parts]
