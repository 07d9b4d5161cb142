"""spinf-serve: read a document once, answer many multiple-choice questions in one pass."""

__version__ = "0.1.0"
