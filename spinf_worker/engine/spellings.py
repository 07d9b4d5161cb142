"""Options asked case-insensitively: an option's logprob is the log of its spellings' summed
probabilities, its probability renormalised over its branch's options, a branch's residual
what its options leave of the next-token mass.

Worked out in numpy for a whole input at once, and the same way for one branch (a floor's,
or an input answered query by query): element-wise exponentials and logarithms and
reductions over the same segments give every figure the same bits either way."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from .runner import DocScores


def summed(spelled: np.ndarray, group_start: np.ndarray, branch_start: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per option (``group_start``: its first spelling in ``spelled``, the spellings'
    logprobs) the log of its spellings' summed probabilities and its probability over its
    branch's options (``branch_start``: each branch's first option); per branch its
    residual. Groups and branches cover their arrays from 0, in order."""
    spelled = spelled.astype(np.float64)
    top = np.maximum.reduceat(spelled, group_start)
    sizes = np.diff(group_start, append=len(spelled))
    logprobs = top + np.log(np.add.reduceat(np.exp(spelled - np.repeat(top, sizes)),
                                            group_start))
    best = np.maximum.reduceat(logprobs, branch_start)
    options = np.diff(branch_start, append=len(logprobs))
    weights = np.exp(logprobs - np.repeat(best, options))
    total = np.add.reduceat(weights, branch_start)
    return (logprobs, weights / np.repeat(total, options),
            np.maximum(0.0, 1.0 - np.exp(best) * total))


@dataclass
class SetSpellings:
    """Where a query set's options' spellings lie among an input's scored strings (the
    runner's options: FlatDoc order), for answering all its inputs in a few array calls."""

    group_start: np.ndarray     # per option: its first spelling among the input's
    branch_start: np.ndarray    # per branch: its first option
    given: np.ndarray           # the options scored as given (a query without spellings)
    given_branches: np.ndarray  # and their branches: the runner's own figures, bit for bit

    @classmethod
    def of(cls, option_start: list[int], spellings: list[list[int] | None],
           options: list[int], grids: list[int]) -> SetSpellings:
        """``option_start``: per branch its first scored string (the set's block);
        per query its spelling starts (None: options as given), options and combinations."""
        groups, given, given_branches, b = [], [], [], 0
        for starts, n, combinations in zip(spellings, options, grids, strict=True):
            for _ in range(combinations):
                at = option_start[b]
                if starts is None:
                    given += range(len(groups), len(groups) + n)
                    given_branches.append(b)
                    groups += range(at, at + n)
                else:
                    groups += (at + s for s in starts)
                b += 1
        branches = [n for n, combinations in zip(options, grids, strict=True)
                    for _ in range(combinations)]
        return cls(np.array(groups, dtype=np.intp),
                   np.array([0, *accumulate(branches)][:-1], dtype=np.intp),
                   np.array(given, dtype=np.intp), np.array(given_branches, dtype=np.intp))

    def figures(self, scores: DocScores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An input's per-option logprobs and probabilities and per-branch residuals."""
        logprobs, probs, residual = summed(scores.option_logprobs, self.group_start,
                                           self.branch_start)
        if len(self.given):
            strings = self.group_start[self.given]
            logprobs[self.given] = scores.option_logprobs[strings]
            probs[self.given] = scores.option_probs[strings]
            residual[self.given_branches] = scores.residual[self.given_branches]
        return logprobs, probs, residual


def branch_figures(scores: DocScores, b: int, starts: list[int]
                   ) -> tuple[list[float], list[float], float]:
    """``summed`` for branch b alone (``starts``: its options' first spellings)."""
    at, end = scores.branch_start[b], scores.branch_start[b + 1]
    logprobs, probs, residual = summed(scores.option_logprobs[at:end],
                                       np.array(starts, dtype=np.intp),
                                       np.zeros(1, dtype=np.intp))
    return logprobs.tolist(), probs.tolist(), residual.item()
