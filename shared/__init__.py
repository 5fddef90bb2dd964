"""lmpipe's common package: wire protocol, batch and control message types, config, metrics, logging."""

__version__ = "0.1.0"
