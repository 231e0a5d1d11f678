"""ZMQ CURVE keys for every channel (client -> daemon or router, router -> instance, KV
transfer, TP step plans), so that only holders of the deployment's client key get in.

Owns a key directory in zmq.auth's certificate format (``zmq.auth.load_certificate`` reads
it), laid out as::

    DIR/server.key  DIR/server.key_secret      the daemon's key pair
    DIR/client.key  DIR/client.key_secret      the key pair handed to trusted clients
    DIR/authorized_clients/*.key               public keys the daemon lets in

One DIR secures a whole deployment (docs/security.md): on every channel the listening end
uses ``server_socket_setup`` and the connecting end ``client_socket_setup`` (client.key_secret
and server.key only). ``pipeline keys DIR`` (``add_args`` / ``main``) makes it. Secret files
are written 0600 and the directory 0700.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AUTHORIZED = "authorized_clients"


def generate_keys(keys_dir: str | Path, overwrite: bool = False) -> Path:
    """Create the server and client key pairs; returns the directory."""
    d = Path(keys_dir)
    if (d / "server.key_secret").exists() and not overwrite:
        raise FileExistsError(f"{d}/server.key_secret exists (pass overwrite=True to replace the keys)")
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in ("server", "client"):
        _, secret = zmq.auth.create_certificates(str(d), name)
        os.chmod(secret, 0o600)
    auth = d / AUTHORIZED
    auth.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(d / "client.key", auth / "client.key")
    return d


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.exists():
        raise FileNotFoundError(f"CURVE key file {path} not found (create keys with generate_keys)")
    public, sec = zmq.auth.load_certificate(str(path))
    if secret and sec is None:
        raise ValueError(f"{path} holds no secret key")
    return public, sec


def server_socket_setup(sock: zmq.Socket, keys_dir: str | Path) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server admitting only the keys in DIR/authorized_clients.

    Call before bind. Returns the running authenticator (one per context); stop it at exit.
    """
    d = Path(keys_dir)
    public, secret = _load(d / "server.key_secret", secret=True)
    auth = ThreadAuthenticator(sock.context)
    auth.start()
    auth.configure_curve(domain="*", location=str(d / AUTHORIZED))
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def client_socket_setup(sock: zmq.Socket, keys_dir: str | Path | None = None,
                        server_key: bytes | str | Path | None = None) -> None:
    """Give ``sock`` the client key pair from DIR and the server's public key (a z85 key,
    a ``server.key`` path, or DIR/server.key). Call before connect."""
    if keys_dir is None:
        raise ValueError("curve_keys_dir is required: the daemon admits only known client keys")
    d = Path(keys_dir)
    public, secret = _load(d / "client.key_secret", secret=True)
    if server_key is None:
        server_public, _ = _load(d / "server.key", secret=False)
    elif isinstance(server_key, (bytes, str)) and len(server_key) == 40 and not Path(os.fsdecode(server_key)).exists():
        server_public = server_key.encode() if isinstance(server_key, str) else server_key
    else:
        server_public, _ = _load(Path(os.fsdecode(server_key)), secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="the key directory to create")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing keys (a rotation: see docs/security.md first)")


def main(args: argparse.Namespace) -> int:
    """`pipeline keys DIR`: make the deployment's keys, say what goes where."""
    try:
        d = generate_keys(args.dir, overwrite=args.overwrite)
    except FileExistsError:
        print(f"pipeline keys: {args.dir} already holds keys; give --overwrite to replace them "
              "(every instance, router and client of the deployment then needs the new ones)",
              file=sys.stderr)
        return 2
    print(f"""CURVE keys written to {d}:
  server.key, server.key_secret   the listening ends (instances, routers, KV listeners)
  client.key, client.key_secret   the connecting ends (clients, routers, prefill instances)
  {AUTHORIZED}/client.key        the client keys the listening ends admit
Copy the whole directory (mode 0700, secrets 0600) to every host of the deployment and give
each `pipeline serve` and `pipeline router` --curve-keys {d}. A client that only connects
needs client.key, client.key_secret and server.key. Rotation: docs/security.md.""")
    return 0
