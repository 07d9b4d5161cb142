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
    path_rows: torch.Tensor      # [branch tokens, L]: own-path rows (branch, option), causal
    path_ok: torch.Tensor        # [branch tokens, L] bool: which path entries are real
    branch_of: torch.Tensor      # [length] branch index per row, -1 for root and padding
    option_of: torch.Tensor      # [length] option sub-branch index per row, -1 elsewhere
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


def _pad_paths(paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged per-token paths -> a zero-padded [tokens, width] matrix and its validity mask."""
    lengths = np.fromiter((len(p) for p in paths), dtype=np.int64, count=len(paths))
    width = int(lengths.max()) if len(paths) else 1
    rows = np.zeros((len(paths), width), dtype=np.int64)
    ok = np.zeros((len(paths), width), dtype=bool)
    if len(paths):
        which = np.repeat(np.arange(len(paths)), lengths)
        col = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        rows[which, col] = np.fromiter((r for p in paths for r in p), dtype=np.int64)
        ok[which, col] = True
    return torch.from_numpy(rows), torch.from_numpy(ok)


@dataclass
class DocTree:
    root: list[int]
    branches: list[Branch] = field(default_factory=list)

    def flatten(self, pad_id: int) -> FlatDoc:
        ids: list[int] = list(self.root)
        pos: list[int] = list(range(len(self.root)))
        paths: list[list[int]] = []          # per branch token: rows it attends to outside the root
        branch_of: list[int] = [-1] * len(self.root)
        option_of: list[int] = [-1] * len(self.root)
        n_options = 0
        readout_rows: list[int] = []
        term_readout: list[int] = []
        term_token: list[int] = []
        term_option: list[int] = []
        option_branch: list[int] = []
        extract: dict[int, tuple[int, list[int], dict]] = {}

        def add_node(tokens: list[int], start_pos: int, parent_path: list[int], branch: int,
                     option: int) -> list[int]:
            """Append a node's tokens; returns the node's full path (parent path + own rows)."""
            path = list(parent_path)
            for j, tok in enumerate(tokens):
                path.append(len(ids))
                paths.append(list(path))
                ids.append(tok)
                pos.append(start_pos + j)
                branch_of.append(branch)
                option_of.append(option)
            return path

        for b, br in enumerate(self.branches):
            branch_path = add_node(br.prefix, len(self.root), [], b, -1)
            # The first option token is predicted by the last template token (the root's
            # last token when the template has no text before its slot).
            first_row = branch_path[-1] if branch_path else len(self.root) - 1
            first_pos = pos[first_row]
            readout_rows.append(first_row)
            shared = len(readout_rows) - 1
            if not br.options:   # an extraction slot: decoded later from this readout
                extract[b] = (shared, [*range(len(self.root)), *branch_path], br.decode or {})
            for opt in br.options:
                k = len(option_branch)
                option_branch.append(b)
                term_readout.append(shared)
                term_token.append(opt[0])
                term_option.append(k)
                option_path = add_node(opt[:-1], first_pos + 1, branch_path, b, n_options)
                n_options += len(opt) > 1
                for row, tok in zip(option_path[len(branch_path):], opt[1:]):
                    readout_rows.append(row)
                    term_readout.append(len(readout_rows) - 1)
                    term_token.append(tok)
                    term_option.append(k)

        tokens = len(ids)
        path_rows, path_ok = _pad_paths(paths)
        pad = -tokens % ROW_TILE
        rpad = -len(readout_rows) % READOUT_TILE
        return FlatDoc(
            input_ids=torch.tensor(ids + [pad_id] * pad, dtype=torch.long),
            positions=torch.tensor(pos + [0] * pad, dtype=torch.long),
            root=len(self.root),
            tokens=tokens,
            path_rows=path_rows,
            path_ok=path_ok,
            branch_of=torch.tensor(branch_of + [-1] * pad, dtype=torch.int32),
            option_of=torch.tensor(option_of + [-1] * pad, dtype=torch.int32),
            readout_rows=torch.tensor(readout_rows + [0] * rpad, dtype=torch.long),
            term_readout=np.array(term_readout, dtype=np.int64),
            term_token=np.array(term_token, dtype=np.int64),
            term_option=np.array(term_option, dtype=np.int64),
            option_branch=np.array(option_branch, dtype=np.int64),
            n_branches=len(self.branches),
            n_option_paths=n_options,
            extract=extract,
        )
