"""A served checkpoint's manifest as the engine holds it: its media, a decision model's code
token ids (what a decision model refuses: spinf_worker/decision_rules.py)."""

from __future__ import annotations

from ..manifest import Decision, Manifest, ManifestError, decodes_slots, read_file
from ..manifest import load as load_manifest
from ..models.loader import Checkpoint


def served_manifest(checkpoint: Checkpoint, kinds: tuple[str, ...]) -> Manifest:
    """The checkpoint's manifest, its media those the model reads (a manifest may list fewer,
    never more); a stack that cannot decode slots has no extract or generate, whatever a
    manifest file lists."""
    manifest = checkpoint.manifest or load_manifest(None, checkpoint.name, checkpoint.config)
    if "media" in (read_file(checkpoint.path) or {}):
        media = [k for k in manifest.media if k in kinds]
    else:
        media = list(kinds)    # inferred: whatever the model reads
    slots = decodes_slots(checkpoint.config)
    capabilities = [c for c in manifest.capabilities
                    if slots or c not in ("extract", "generate")]
    return manifest.model_copy(update={"media": media, "capabilities": capabilities})


def code_ids(decision: Decision, tokenizer, model: str) -> list[int]:
    """Each code's one token id (a code of several tokens is a bad manifest)."""
    ids = []
    for code in decision.codes:
        found = tokenizer.encode(code, add_special_tokens=False).ids
        if len(found) != 1:
            raise ManifestError(f"{model}: decision code {code!r} is {len(found)} tokens, not one",
                                param="model")
        ids.append(found[0])
    return ids
