"""Row tiles shared by the engine and the torch-free queue tier.

A document starts at, and is padded to, a multiple of ROW_TILE rows in a pass, so its key
blocks are laid out the same wherever it lands; the LM head runs over each document's readout
rows padded to READOUT_TILE. Both are fixed: changing either moves scores' bits.
"""

ROW_TILE = 128      # body rows: the document alignment
READOUT_TILE = 32   # LM-head rows: each document's readouts are padded to this


def padded_rows(tokens: int) -> int:
    """Rows a document of ``tokens`` real rows takes in a pass."""
    return -(-tokens // ROW_TILE) * ROW_TILE
