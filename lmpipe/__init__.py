"""lmpipe: the command line, the local launcher, and the library (`from lmpipe import Loader`)."""

from typing import Any

from lmpipe.shared import __version__

__all__ = ["Loader", "__version__", "block_mask", "dense_mask"]


def __getattr__(name: str) -> Any:
    """Loader and the mask helpers load on first use: `import lmpipe` stays free of torch."""
    if name == "Loader":
        from lmpipe.loader import Loader

        return Loader
    if name in ("block_mask", "dense_mask"):
        from lmpipe.consumer import batchdict

        return getattr(batchdict, name)
    raise AttributeError(f"module 'lmpipe' has no attribute {name!r}")
