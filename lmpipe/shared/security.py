"""ZeroMQ CURVE: encrypted, authenticated sockets between producers and the trainer.

`lmpipe keys --out DIR` makes one key directory for a deployment:
  server.key / server.key_secret   the trainer's key pair
  client.key / client.key_secret   the producers' key pair
  authorized/client.key            public keys the trainer accepts (add more to admit other producers)
The trainer gets the whole directory (`--curve-dir`), producers need client.key_secret and server.key only.
A ZAP handler (`start_zap`, on its own thread) checks each connecting producer's public key against
`authorized/`; a producer with another key never completes the connection, so it never reaches lmpipe's
handshake. Which transport is used when is decided in shared/sockets.py; SECURITY.md has the threat model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from lmpipe.shared.config import is_loopback


def check_bind(host: str, trusted_network: bool, curve_dir: str | None) -> None:
    """The trainer's bind policy: loopback, or CURVE keys, or the user's word that the network is private."""
    if not is_loopback(host) and not (trusted_network or curve_dir):
        raise ValueError(
            f"refusing to bind {host}: not a loopback address and traffic is unencrypted; "
            "give CURVE keys (--curve-dir, made by `lmpipe keys`) or pass --trusted-network if this "
            "network is private"
        )


def check_connect(host: str, trusted_network: bool, curve_dir: str | None) -> None:
    """The producer's side of the same policy: no unauthenticated connection to another host unasked."""
    if not is_loopback(host) and not (trusted_network or curve_dir):
        raise ValueError(
            f"refusing to connect to {host} unencrypted and unauthenticated; give CURVE keys (--curve-dir, "
            "made by `lmpipe keys`) or pass --trusted-network if this network is private"
        )


class _Authenticator(ThreadAuthenticator):
    def curve_user_id(self, client_public_key: bytes) -> str:
        # No User-Id: libzmq would queue it as a "credential" message ahead of a connection's first batch,
        # and while it is alone in the pipe, the socket reports POLLIN but a read finds nothing (EAGAIN).
        return ""


def start_zap(ctx: zmq.Context, curve_dir: str | Path) -> ThreadAuthenticator:
    """The ZAP handler of a trainer's context: admits CURVE clients whose public key is in authorized/.
    It runs on its own thread, so rejecting a storm of strangers never holds up the receive loop."""
    location = authorized_dir(curve_dir)
    _load(Path(curve_dir) / "server.key_secret", secret=True)  # fail before anything starts
    auth = _Authenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=location)
    return auth


KEY_FILES = ("server.key", "server.key_secret", "client.key", "client.key_secret")


def generate_keys(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; name a directory for the keys")
    # any one of them: a lone client.key copied here was replaced before
    if held := [n for n in KEY_FILES if (out / n).exists()]:
        raise ValueError(
            f"--out {out} already holds {', '.join(held)}; remove them first (new keys would lock out the "
            "producers that use these)"
        )
    out.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(out, "server")
    zmq.auth.create_certificates(out, "client")
    (out / "authorized").mkdir(exist_ok=True)
    shutil.copy(out / "client.key", out / "authorized" / "client.key")
    for secret in out.glob("*.key_secret"):
        secret.chmod(0o600)
    return out


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"CURVE key file not found: {path} (make keys with `lmpipe keys --out DIR`)")
    try:
        public, private = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a ZeroMQ certificate ({exc})") from None
    if secret and private is None:
        raise ValueError(f"{path}: holds no secret key")
    return public, private


def server_sockets(sockets: list[zmq.Socket], key_dir: str | Path) -> None:
    public, secret = _load(Path(key_dir) / "server.key_secret", secret=True)
    for s in sockets:
        s.curve_secretkey = secret
        s.curve_publickey = public
        s.curve_server = True


def client_sockets(sockets: list[zmq.Socket], key_dir: str | Path) -> None:
    d = Path(key_dir)
    public, secret = _load(d / "client.key_secret", secret=True)
    server_public, _ = _load(d / "server.key", secret=False)
    for s in sockets:
        s.curve_secretkey = secret
        s.curve_publickey = public
        s.curve_serverkey = server_public


def authorized_dir(key_dir: str | Path) -> str:
    d = Path(key_dir) / "authorized"
    if not d.is_dir() or not any(d.glob("*.key")):
        raise FileNotFoundError(f"{d}: no authorized producer keys")
    return str(d)
