"""Downloads: resolve sources, resume, verify, progress. See `puller.pull_model`."""

from .download import RetryPolicy, Transport, UrllibTransport, download_file
from ..protocol.progress import Progress, PullEvent
from .puller import pull_model

__all__ = ["pull_model", "PullEvent", "Progress", "RetryPolicy", "Transport", "UrllibTransport", "download_file"]
