"""The read-once tree: one DocTree per document.

``root`` = BOS + the presented content. One branch per (query, combination) holds the template
text up to its ``{?}``; a multi-token option gets a sub-branch holding all its tokens but the
last. A branch's tokens take the positions right after its parent's last position, so every
branch sees exactly what a one-question prompt would see.

Readouts are the rows whose logits predict an option token: the last token of a branch (its
first option token, shared by all options) and each sub-branch token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from ..kernels.matmul import READOUT_TILE, ROW_TILE


@dataclass
class Branch:
    prefix: list[int]            # template tokens up to the slot (no BOS)
    options: list[list[int]]     # each option's tokens, in request order; [] for extraction
    decode: dict | None = None   # extraction slots: SlotJob settings (engine/decode.py)


@dataclass
class FlatDoc:
    """A DocTree flattened into padded rows, ready to be placed in a pass."""

    input_ids: torch.Tensor      # [length] (padded to ROW_TILE)
    positions: torch.Tensor      # [length]
    root: int                    # rows [0, root) hold the root
    tokens: int                  # real (unpadded) rows; [root, tokens) are branch tokens
    branch_of: torch.Tensor      # [length] branch index per row, -1 for root and padding
    option_of: torch.Tensor      # [length] option sub-branch index per row, -1 elsewhere
    # Where each branch's template rows start and how many there are, and where each option
    # sub-branch starts: a branch token's own path is its template rows up to itself, or all
    # of them and then its sub-branch rows up to itself.
    branch_start: np.ndarray     # [branches]
    branch_len: np.ndarray       # [branches]
    option_start: np.ndarray     # [option sub-branches]
    readout_rows: torch.Tensor   # [n_readouts padded to READOUT_TILE] row within the document
    # An option's logprob is the sum of its summands: (readout index, token id) pairs, listed
    # option after option; option k belongs to branch option_branch[k].
    term_readout: np.ndarray     # [summands] readout index
    term_token: np.ndarray       # [summands] the token whose logprob is read there
    term_option: np.ndarray      # [summands] option index within the document
    option_branch: np.ndarray    # [options] branch index
    n_branches: int
    n_option_paths: int          # option sub-branches (options of several tokens)
    # extraction branches: branch -> (readout index, context rows (root + branch), settings)
    extract: dict[int, tuple[int, list[int], dict]] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_position(self) -> int:
        return int(self.positions[: self.tokens].max())

    @cached_property
    def paths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per branch token its own-path rows, zero-padded to ``[branch tokens, L]``, and which
        entries are real (causal: up to the token itself). Only the CPU attention asks."""
        rows = np.arange(self.root, self.tokens)
        branch = self.branch_of[self.root:self.tokens].numpy().astype(np.int64)
        option = self.option_of[self.root:self.tokens].numpy().astype(np.int64)
        start, length = self.branch_start[branch], self.branch_len[branch]
        in_option = option >= 0
        own = np.where(in_option, length, rows - start + 1)           # template rows on the path
        tail = np.where(in_option, rows - self.option_start[np.maximum(option, 0)] + 1, 0)
        width = int((own + tail).max()) if len(rows) else 1
        col = np.arange(width)[None, :]
        path = np.where(col < own[:, None], start[:, None] + col,
                        self.option_start[np.maximum(option, 0)][:, None] + col - own[:, None])
        ok = col < (own + tail)[:, None]
        return torch.from_numpy(np.where(ok, path, 0)), torch.from_numpy(ok)


@dataclass
class BranchBlock:
    """The branches of a DocTree laid out after a root of any length: rows and positions
    relative to the root's end (row ``root + r``, position ``root + p``). Bulk jobs ask the
    same questions of every document, so one block is built once and placed after each
    document's root (``place``)."""

    ids: np.ndarray              # [branch tokens]
    pos: np.ndarray              # [branch tokens] position - root
    branch_of: np.ndarray        # [branch tokens]
    option_of: np.ndarray        # [branch tokens] -1 outside option sub-branches
    branch_start: np.ndarray     # [branches] row - root
    branch_len: np.ndarray       # [branches]
    option_start: np.ndarray     # [option sub-branches] row - root
    readout_rows: np.ndarray     # [readouts] row - root (-1: the root's last token)
    term_readout: np.ndarray
    term_token: np.ndarray
    term_option: np.ndarray
    option_branch: np.ndarray
    n_scored: int                # option tokens read out (usage)
    # extraction branches: branch -> (readout index, settings)
    extract: dict[int, tuple[int, dict]] = field(default_factory=dict)

    @classmethod
    def build(cls, branches: list[Branch]) -> BranchBlock:
        ids: list[int] = []
        pos: list[int] = []
        branch_of: list[int] = []
        option_of: list[int] = []
        branch_start: list[int] = []
        option_start: list[int] = []
        readout_rows: list[int] = []
        term_readout: list[int] = []
        term_token: list[int] = []
        term_option: list[int] = []
        option_branch: list[int] = []
        extract: dict[int, tuple[int, dict]] = {}

        def add_rows(tokens: list[int], start_pos: int, branch: int, option: int) -> int:
            """Append a node's tokens; returns the row of its first token."""
            first = len(ids)
            ids.extend(tokens)
            pos.extend(range(start_pos, start_pos + len(tokens)))
            branch_of.extend([branch] * len(tokens))
            option_of.extend([option] * len(tokens))
            return first

        for b, br in enumerate(branches):
            start = add_rows(br.prefix, 0, b, -1)
            branch_start.append(start)
            # The first option token is predicted by the last template token (the root's
            # last token when the template has no text before its slot).
            first_row = start + len(br.prefix) - 1 if br.prefix else -1
            first_pos = len(br.prefix) - 1
            readout_rows.append(first_row)
            shared = len(readout_rows) - 1
            if not br.options:   # an extraction slot: decoded later from this readout
                extract[b] = (shared, br.decode or {})
            for opt in br.options:
                k = len(option_branch)
                option_branch.append(b)
                term_readout.append(shared)
                term_token.append(opt[0])
                term_option.append(k)
                if len(opt) > 1:   # a sub-branch holding all its tokens but the last
                    first = add_rows(opt[:-1], first_pos + 1, b, len(option_start))
                    option_start.append(first)
                    for j, tok in enumerate(opt[1:]):
                        readout_rows.append(first + j)
                        term_readout.append(len(readout_rows) - 1)
                        term_token.append(tok)
                        term_option.append(k)

        def arr(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)

        return cls(arr(ids), arr(pos), arr(branch_of), arr(option_of), arr(branch_start),
                   arr([len(br.prefix) for br in branches]), arr(option_start),
                   arr(readout_rows), arr(term_readout), arr(term_token), arr(term_option),
                   arr(option_branch), sum(len(o) for br in branches for o in br.options),
                   extract)

    @property
    def n_branches(self) -> int:
        return len(self.branch_start)

    def place(self, root_ids: list[int], pad_id: int) -> FlatDoc:
        """The FlatDoc of these branches after ``root_ids``."""
        root = len(root_ids)
        tokens = root + len(self.ids)
        pad = -tokens % ROW_TILE
        rpad = -len(self.readout_rows) % READOUT_TILE

        def rows(root_part: np.ndarray, branch_part: np.ndarray, fill: int,
                 dtype=torch.long) -> torch.Tensor:
            out = np.concatenate([root_part, branch_part, np.full(pad, fill, dtype=np.int64)])
            return torch.from_numpy(out).to(dtype)

        none = np.full(root, -1, dtype=np.int64)
        return FlatDoc(
            input_ids=rows(np.asarray(root_ids, dtype=np.int64), self.ids, pad_id),
            positions=rows(np.arange(root), self.pos + root, 0),
            root=root,
            tokens=tokens,
            branch_of=rows(none, self.branch_of, -1, torch.int32),
            option_of=rows(none, self.option_of, -1, torch.int32),
            branch_start=self.branch_start + root,
            branch_len=self.branch_len,
            option_start=self.option_start + root if len(self.option_start) else np.zeros(1, np.int64),
            readout_rows=torch.from_numpy(np.concatenate(
                [self.readout_rows + root, np.zeros(rpad, dtype=np.int64)])),
            term_readout=self.term_readout,
            term_token=self.term_token,
            term_option=self.term_option,
            option_branch=self.option_branch,
            n_branches=self.n_branches,
            n_option_paths=len(self.option_start),
            extract={b: (r, [*range(root), *range(root + self.branch_start[b],
                                                  root + self.branch_start[b] + self.branch_len[b])],
                         settings)
                     for b, (r, settings) in self.extract.items()},
        )


@dataclass
class DocTree:
    root: list[int]
    branches: list[Branch] = field(default_factory=list)

    def flatten(self, pad_id: int) -> FlatDoc:
        return BranchBlock.build(self.branches).place(self.root, pad_id)
