"""``kvmem ui``: the planner as a web page, with its JSON API on the same port.

Serves ``kvmem.ui`` until interrupted; prints the URL first (``--port 0`` takes a free
port), and a warning when the address reaches beyond this machine's loopback: the page has
no authentication. Imports no torch.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys

from kvmem.errors import KvmemError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: loopback only; the page has no "
                        "authentication, so another address warns)")
    p.add_argument("--port", type=int, default=8765,
                   help="port to listen on; 0 takes a free one (default 8765)")
    p.add_argument("--verbose", action="store_true", help="log every request")


def run(args: argparse.Namespace) -> int:
    from kvmem.ui.server import UIServer

    if not 0 <= args.port <= 65535:
        raise KvmemError(f"--port must be in 0-65535, got {args.port}")
    try:
        server = UIServer(args.host, args.port, verbose=args.verbose)
    except OSError as e:
        raise KvmemError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e})") from None
    print(f"kvmem ui: {server.url}  (plan API: {server.url}api/plan?model=...)", flush=True)
    if not ipaddress.ip_address(server.server_address[0]).is_loopback:
        print(f"kvmem ui: warning: listening on {args.host}, beyond this machine's loopback; "
              "the page has no authentication: anyone who can reach this port can use it",
              file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
