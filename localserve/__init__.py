"""localserve: a local LLM server with padding-free continuous batching and priority lanes."""

__version__ = "0.1.0"
