"""tokenize -> layout (DocTree) -> packer (Pass) -> runner (forward) -> scores."""

from .engine import Engine, EngineSettings

__all__ = ["Engine", "EngineSettings"]
