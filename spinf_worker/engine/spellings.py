"""Options asked case-insensitively: an option's logprob is the log of its spellings' summed
probabilities, its probability renormalised over its branch's options, a branch's residual
what its options leave of the next-token mass.

Worked out in numpy for a whole input at once, and the same way for one branch (a floor's,
or an input answered query by query): element-wise exponentials and logarithms (the C
library's, engine/host_math.py) and reductions over the same segments give every figure the
same bits either way."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import host_math
from .runner import DocScores

Segments = tuple[np.ndarray, np.ndarray]   # per segment its first element and its length


def segments(start: np.ndarray, total: int) -> Segments:
    """Segments from their starts, the last one ending at ``total``."""
    return start, np.diff(start, append=total)


def summed(spelled: np.ndarray, groups: Segments, branches: Segments
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per option (``groups``: its spellings in ``spelled``, their logprobs) the log of its
    spellings' summed probabilities and its probability over its branch's options
    (``branches``: each branch's options); per branch its residual. The segments cover
    their arrays from 0, in order."""
    spelled = spelled.astype(np.float64)
    (group_start, group_size), (branch_start, branch_size) = groups, branches
    top = np.maximum.reduceat(spelled, group_start)
    logprobs = top + host_math.log(np.add.reduceat(
        host_math.exp(spelled - np.repeat(top, group_size)), group_start))
    best = np.maximum.reduceat(logprobs, branch_start)
    weights = host_math.exp(logprobs - np.repeat(best, branch_size))
    total = np.add.reduceat(weights, branch_start)
    return (logprobs, weights / np.repeat(total, branch_size),
            np.maximum(0.0, 1.0 - host_math.exp(best) * total))


@dataclass
class SetSpellings:
    """Where a query set's options' spellings lie among an input's scored strings (the
    runner's options: FlatDoc order), for answering all its inputs in a few array calls."""

    groups: Segments            # per option: its spellings among the input's
    branches: Segments          # per branch: its options
    given: np.ndarray           # the options scored as given (a query without spellings)
    given_branches: np.ndarray  # and their branches: the runner's own figures, bit for bit

    @classmethod
    def of(cls, string_start: list[int], option_start: list[int],
           spellings: list[list[int] | None], grids: list[int]) -> SetSpellings:
        """Per branch (+ 1) its first scored string (the set's block) and its first option;
        per query its spelling starts (None: options as given) and its combinations."""
        branch_spellings = [starts for starts, combinations in zip(spellings, grids, strict=True)
                            for _ in range(combinations)]
        groups, given, given_branches = [], [], []
        for b, starts in enumerate(branch_spellings):
            at = string_start[b]
            if starts is None:
                n = option_start[b + 1] - option_start[b]
                given += range(len(groups), len(groups) + n)
                given_branches.append(b)
                groups += range(at, at + n)
            else:
                groups += (at + s for s in starts)
        return cls(segments(np.array(groups, dtype=np.intp), string_start[-1]),
                   segments(np.array(option_start[:-1], dtype=np.intp), option_start[-1]),
                   np.array(given, dtype=np.intp), np.array(given_branches, dtype=np.intp))

    def figures(self, scores: DocScores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An input's per-option logprobs and probabilities and per-branch residuals."""
        logprobs, probs, residual = summed(scores.option_logprobs, self.groups, self.branches)
        if len(self.given):
            strings = self.groups[0][self.given]
            logprobs[self.given] = scores.option_logprobs[strings]
            probs[self.given] = scores.option_probs[strings]
            residual[self.given_branches] = scores.residual[self.given_branches]
        return logprobs, probs, residual


def branch_figures(scores: DocScores, b: int, starts: list[int]
                   ) -> tuple[list[float], list[float], float]:
    """``summed`` for branch b alone (``starts``: its options' first spellings)."""
    at, end = scores.branch_start[b], scores.branch_start[b + 1]
    options = len(starts)
    logprobs, probs, residual = summed(
        scores.option_logprobs[at:end], segments(np.array(starts, dtype=np.intp), end - at),
        (np.zeros(1, dtype=np.intp), np.array([options], dtype=np.intp)))
    return logprobs.tolist(), probs.tolist(), residual.item()
