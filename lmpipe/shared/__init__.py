"""lmpipe's common package: wire protocol, batch and control message types, config, metrics, logging."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmpipe")  # the one version string: pyproject.toml's, via the package metadata
except PackageNotFoundError:  # a checkout on PYTHONPATH, never installed
    __version__ = "0+unknown"
