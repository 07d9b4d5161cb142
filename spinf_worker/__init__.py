"""spinf-serve: read a document once, answer many multiple-choice questions in one pass.

The engine is ``spinf_worker.engine.Engine``; this package itself imports nothing, so the
torch-free modules (protocol, templates, packs, errors) and the API tier stay torch-free."""

__version__ = "0.1.0"
