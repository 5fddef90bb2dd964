"""lmpipe: the command line and the local launcher that ties producers and trainer together."""

from lmpipe.shared import __version__

__all__ = ["__version__"]
