"""Row tiles shared by the engine and the torch-free queue tier.

A document starts at, and is padded to, a multiple of ROW_TILE rows in a pass, so its key
blocks are laid out the same wherever it lands; the LM head runs over each document's readout
rows padded to READOUT_TILE. All are fixed: changing one moves scores' bits.
"""

ROW_TILE = 128      # body rows: the document alignment
READOUT_TILE = 32   # LM-head rows: each document's readouts are padded to this
# CPU attention of branch rows: a tile of rows at a time, over the root and a path padded to
# a power of two of at least PATH_MIN, so a row's shapes depend on its own path alone
BRANCH_TILE = 32
PATH_MIN = 8


def padded_rows(tokens: int) -> int:
    """Rows a document of ``tokens`` real rows takes in a pass."""
    return -(-tokens // ROW_TILE) * ROW_TILE
