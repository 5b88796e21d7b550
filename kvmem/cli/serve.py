"""``kvmem serve [MODEL]``: an OpenAI-compatible HTTP server (127.0.0.1:8000 by default)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import threading

from kvmem.errors import KvmemError

# SIGINT/SIGTERM: in-flight requests get this long to finish, then the engine fails those
# still running, so each response ends with an error (a 503 body, or an error event and
# [DONE] on a stream); uvicorn cancels what is left only after a further margin.
GRACEFUL_SHUTDOWN_S = 5.0
_CANCEL_MARGIN_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvmem.engine.config import add_engine_arguments

    add_engine_arguments(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    g.add_argument("--port", type=int, default=8000,
                   help="port to listen on (0: one the system picks, printed as "
                        "'kvmem: listening on URL')")
    g.add_argument("--api-key", default=os.environ.get("KVMEM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $KVMEM_API_KEY)")
    g.add_argument("--public-metrics", action="store_true",
                   help="serve /metrics without the API key")
    g.add_argument("--max-request-bytes", default="16MiB", metavar="SIZE",
                   help="refuse request bodies larger than this with 413 (default: 16MiB)")
    g.add_argument("--request-head-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="answer 408 and close a connection whose next request line and "
                        "headers have not arrived within this many seconds (default: 60)")
    g.add_argument("--request-body-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="answer 408 to a request whose body has not arrived whole within "
                        "this many seconds (default: 60)")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL writes it: an IPv6 literal in brackets (``[::1]:8000``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise KvmemError(f"cannot listen on {host_port(host, port)}: {e.strerror}") from None
    return sock


def _server_class(base: type) -> type:
    """``base`` (uvicorn.Server) that, once asked to exit, gives in-flight requests
    GRACEFUL_SHUTDOWN_S and then fails the ones still running in the engine."""

    class Server(base):
        def __init__(self, config, engine) -> None:
            super().__init__(config)
            self._abort_timer = threading.Timer(
                GRACEFUL_SHUTDOWN_S, engine.abort_all,
                args=("the server is shutting down; the request was aborted",))
            self._abort_timer.daemon = True

        def handle_exit(self, sig, frame) -> None:
            from kvmem.memory import status_stream

            super().handle_exit(sig, frame)
            status_stream.end_all()  # open status streams would hold the shutdown
            if self._abort_timer.ident is None:  # the first signal starts the countdown
                self._abort_timer.start()

    return Server


def run(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvmem.engine.async_engine import AsyncLLMEngine
    from kvmem.engine.config import EngineConfig
    from kvmem.engine.gc_heap import freeze_startup_heap
    from kvmem.engine.llm_engine import LLMEngine
    from kvmem.serve import create_app
    from kvmem.serve.head_timeout import head_timeout_protocol
    from kvmem.units import parse_size

    if not 0 <= args.port <= 65535:
        raise KvmemError(f"--port must be in 0..65535, got {args.port}")
    max_request_bytes = parse_size(args.max_request_bytes, "--max-request-bytes")
    # a request needs some time to arrive: below a second ordinary clients would get 408
    for flag, value in (("--request-head-timeout", args.request_head_timeout),
                        ("--request-body-timeout", args.request_body_timeout)):
        if not 1 <= value <= 86400:  # nan and inf fail too
            raise KvmemError(f"{flag} must be from 1 to 86400 seconds, got {value:g}")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine_config = EngineConfig.from_args(args)
    parallel = None
    if engine_config.world_size > 1:  # torchrun's rank variables, read once, here
        from kvmem.engine.distributed import from_torchrun_env, run_launched_worker

        parallel = from_torchrun_env(engine_config)
        if parallel is not None and parallel.rank != 0:
            return run_launched_worker(engine_config, parallel)  # rank 0 serves HTTP
    sock = _listen(args.host, args.port)  # fail before loading the model if the port is taken
    host, port = sock.getsockname()[:2]
    if args.port == 0:  # picked by the system: say which, whatever the log level
        print(f"kvmem: listening on http://{host_port(host, port)}", flush=True)
    engine = LLMEngine(engine_config, parallel=parallel)
    freeze_startup_heap()  # what serving allocates is all a collection walks
    async_engine = AsyncLLMEngine(engine)
    app = create_app(async_engine, api_key=args.api_key, max_request_bytes=max_request_bytes,
                     request_body_timeout_s=args.request_body_timeout,
                     public_metrics=args.public_metrics)
    config = uvicorn.Config(app, log_level=args.log_level,
                            http=head_timeout_protocol(args.request_head_timeout),
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S + _CANCEL_MARGIN_S)
    logging.getLogger("kvmem.serve").info("serving %s on http://%s", engine.model_name,
                                          host_port(host, port))
    # uvicorn turns SIGINT/SIGTERM into a graceful shutdown, then re-raises the signal to
    # the handlers that were installed before it started: make those a no-op so that a
    # requested shutdown exits 0 instead of dying by the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server = _server_class(uvicorn.Server)(config, async_engine)
    if engine.parallel is not None:  # a failed rank stops the server, which then exits 2
        engine.parallel.on_failure(lambda _: setattr(server, "should_exit", True))
    server.run(sockets=[sock])
    if engine.parallel is not None:  # a stop under torchrun may follow a node's death
        engine.parallel.check_peers()
    engine.shutdown()
    if engine.parallel is not None and engine.parallel.error is not None:
        raise engine.parallel.error
    return 0
