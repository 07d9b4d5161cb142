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

import torch

from ..kernels.matmul import READOUT_TILE, ROW_TILE


@dataclass
class Branch:
    prefix: list[int]            # template tokens up to the scored slot (no BOS)
    options: list[list[int]]     # each option's tokens, in request order


@dataclass
class FlatDoc:
    """A DocTree flattened into padded rows, ready to be placed in a pass."""

    input_ids: torch.Tensor      # [length] (padded to ROW_TILE)
    positions: torch.Tensor      # [length]
    node: torch.Tensor           # [length] tree node per row, -1 for padding
    ancestors: torch.Tensor      # [nodes, nodes] bool: column node is row node or its ancestor
    readout_rows: torch.Tensor   # [n_readouts padded to READOUT_TILE] row within the document
    # terms[b][o] = [(readout index, token id), ...]: option o of branch b's logprob summands
    terms: list[list[list[tuple[int, int]]]]
    tokens: int                  # real (unpadded) tokens
    max_position: int

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class DocTree:
    root: list[int]
    branches: list[Branch] = field(default_factory=list)

    def flatten(self, pad_id: int) -> FlatDoc:
        ids: list[int] = list(self.root)
        pos: list[int] = list(range(len(self.root)))
        node: list[int] = [0] * len(self.root)
        parents: list[int] = [-1]
        readout_rows: list[int] = []
        terms: list[list[list[tuple[int, int]]]] = []

        def add_node(parent: int, tokens: list[int], start_pos: int) -> int:
            nid = len(parents)
            parents.append(parent)
            ids.extend(tokens)
            pos.extend(range(start_pos, start_pos + len(tokens)))
            node.extend([nid] * len(tokens))
            return nid

        for br in self.branches:
            b_node = add_node(0, br.prefix, len(self.root))
            # The first option token is predicted by the last template token (the root's
            # last token when the template has no text before its slot).
            first_row = len(ids) - 1 if br.prefix else len(self.root) - 1
            first_pos = pos[first_row]
            readout_rows.append(first_row)
            shared = len(readout_rows) - 1
            br_terms = []
            for opt in br.options:
                opt_terms = [(shared, opt[0])]
                if len(opt) > 1:
                    add_node(b_node, opt[:-1], first_pos + 1)
                    sub_start = len(ids) - (len(opt) - 1)
                    for j, tok in enumerate(opt[1:]):
                        readout_rows.append(sub_start + j)
                        opt_terms.append((len(readout_rows) - 1, tok))
                br_terms.append(opt_terms)
            terms.append(br_terms)

        n_nodes = len(parents)
        ancestors = torch.eye(n_nodes, dtype=torch.bool)
        for nid in range(1, n_nodes):   # parents precede children: one pass fills closure
            ancestors[nid] |= ancestors[parents[nid]]
            ancestors[nid, nid] = True

        tokens = len(ids)
        pad = -tokens % ROW_TILE
        rpad = -len(readout_rows) % READOUT_TILE
        return FlatDoc(
            input_ids=torch.tensor(ids + [pad_id] * pad, dtype=torch.long),
            positions=torch.tensor(pos + [0] * pad, dtype=torch.long),
            node=torch.tensor(node + [-1] * pad, dtype=torch.long),
            ancestors=ancestors,
            readout_rows=torch.tensor(readout_rows + [0] * rpad, dtype=torch.long),
            terms=terms,
            tokens=tokens,
            max_position=max(pos),
        )
