"""spinf-serve: read a document once, answer many multiple-choice questions in one pass."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy so that `spinf_worker.protocol` (used by the torch-free API tier) never imports torch.
    if name in ("Engine", "EngineSettings"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(name)
