"""``kvmem serve [MODEL]``: an OpenAI-compatible HTTP server (127.0.0.1:8000 by default)."""

from __future__ import annotations

import argparse
import os
import signal
import socket

from kvmem.errors import KvmemError


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvmem.engine.config import add_engine_arguments

    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("KVMEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $KVMEM_API_KEY)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KvmemError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app

    if not 0 <= args.port <= 65535:
        raise KvmemError(f"--port must be in 0..65535, got {args.port}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_config = EngineConfig.from_args(args)
    parallel = None
    if engine_config.world_size > 1:  # torchrun's rank variables, read once, here
        from kvmem.engine.distributed import from_torchrun_env, run_launched_worker

        parallel = from_torchrun_env(engine_config)
        if parallel is not None and parallel.rank != 0:
            return run_launched_worker(engine_config, parallel)  # rank 0 serves HTTP
    sock = _listen(args.host, args.port)  # fail before loading the model if the port is taken
    engine = LLMEngine(engine_config, parallel=parallel)
    app = create_app(AsyncLLMEngine(engine), api_key=args.api_key)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    host, port = sock.getsockname()[:2]
    logging.getLogger("kvmem.serve").info("serving %s on http://%s:%d", engine.model_name,
                                          host, port)
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal to
    # the handlers that were installed before it started: make those a no-op so that a
    # requested shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = uvicorn.Server(config)
    if engine.parallel is not None:  # a failed rank stops the server, which then exits 2
        engine.parallel.on_failure(lambda _: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
    engine.shutdown()
    if engine.parallel is not None and engine.parallel.error is not None:
        raise engine.parallel.error
    return 0
