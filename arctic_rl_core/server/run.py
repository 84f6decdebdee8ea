"""Running the server: `arctic-rl serve`, and an in-thread server for tests and benchmarks."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time

import uvicorn

from arctic_rl_core.config import BackendConfig
from arctic_rl_core.server.app import ServerSettings, create_app
from arctic_rl_core.server.connections import timed_protocol
from arctic_rl_core.server.limits import RequestLimits
from arctic_rl_core.server.security import TOKEN_ENV, check_bind


def _backend_factory(config: BackendConfig):
    from arctic_rl_core.backend import InProcessBackend

    return InProcessBackend(config, served=True)


def _server_process_backend(config: BackendConfig):
    """`arctic-rl serve`'s, whose process is the server's alone: once the job has loaded, what it loaded (the trainer,
    the tokenizer, the sampler's state) leaves the cycle collector's reach, as vLLM's engine core freezes its heap once
    loaded. A full collection otherwise walked all of it while holding the interpreter lock: measured in a served tiny
    job, up to 0.7 s, every request in flight stalled meanwhile."""
    api = _backend_factory(config)
    gc.collect()
    gc.freeze()
    return api


def build_server(settings: ServerSettings, config: BackendConfig | None = None, backend_factory=_backend_factory) -> uvicorn.Server:
    check_bind(settings.host, settings.token)
    app = create_app(settings, backend_factory)
    if config is not None:
        app.state.job.api, app.state.job.config = backend_factory(config), config
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           http=timed_protocol(settings.header_timeout_s), lifespan="off",
                                           # uvicorn counts the asking connection among those open
                                           limit_concurrency=settings.max_connections + 1,
                                           timeout_keep_alive=settings.keep_alive_s))
    app.state.job.shutdown = lambda: setattr(server, "should_exit", True)
    return server


def close_job(server: uvicorn.Server) -> None:
    """Stop what the server's job started outside this process (Ray actors of ranks and replicas), and remove the
    temporary checkpoint directory if nothing was saved there."""
    close = getattr(server.config.app.state.job.api, "close", None)
    if close is not None:
        close()
    settings = server.config.app.state.settings
    if settings.temporary_checkpoint_dir:
        try:
            os.rmdir(settings.checkpoint_dir)
        except OSError:  # checkpoints were saved there: they stay
            pass


class ServerThread:
    """A server on a background thread (tests, benchmarks): `with ServerThread(settings) as url: ...`."""

    def __init__(self, settings: ServerSettings, config: BackendConfig | None = None, backend_factory=_backend_factory):
        self.server = build_server(settings, config, backend_factory)
        self.settings = settings
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def app(self):
        return self.server.config.app

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return f"http://{self.settings.host}:{self.settings.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        close_job(self.server)


def tinker_keys(path: str | None) -> dict[str, str] | None:
    if path is None:
        return None
    from arctic_rl_core.errors import InvalidRequest
    from arctic_rl_core.tinker.tenants import read_keys

    try:
        return read_keys(path)
    except InvalidRequest as err:
        raise SystemExit(f"--tinker-keys: {err}") from None


def main(args) -> int:
    import yaml

    from arctic_rl_core.validation import parse

    token = args.token or os.environ.get(TOKEN_ENV)
    config = None
    if args.config:
        with open(args.config) as f:
            config = parse(BackendConfig, yaml.safe_load(f), args.config)
    if args.tinker_tenants < 1:
        raise SystemExit(f"--tinker-tenants {args.tinker_tenants}: at least 1")
    limits = RequestLimits()
    for item in args.limit:
        name, _, value = item.partition("=")
        if name not in RequestLimits.names() or not value.isdigit():
            raise SystemExit(f"--limit {item}: expected NAME=INTEGER with NAME one of {', '.join(RequestLimits.names())}")
        setattr(limits, name, int(value))
    if args.max_connections < 1:
        raise SystemExit(f"--max-connections {args.max_connections}: at least 1")
    if args.tool_call_parser is not None:
        from arctic_rl_core.serving.tool_calls import parser_class

        try:
            parser_class(args.tool_call_parser, None)  # the name; the model's tokenizer is checked as it loads
        except ValueError as err:
            raise SystemExit(str(err)) from None
    settings = ServerSettings(host=args.host, port=args.port, token=token, max_request_bytes=args.max_request_mb * 2**20,
                              max_connections=args.max_connections, checkpoint_dir=args.checkpoint_dir, limits=limits,
                              served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
                              tinker_full_parameter=args.tinker_full_parameter, tinker_tenants=args.tinker_tenants,
                              tinker_keys=tinker_keys(args.tinker_keys))
    check_bind(settings.host, settings.token)
    listener = _bound(settings.host, settings.port)
    server = build_server(settings, config, _server_process_backend)
    print(f"Arctic RL serving on http://{args.host}:{args.port} (job {'loaded' if config else 'not initialized'}; "
          f"checkpoints under {settings.checkpoint_root()})", flush=True)
    # uvicorn shuts down on SIGTERM, then raises the signal again under the handler it found: under the default one
    # the process would die there, before `close_job`, and what the job started outside it (a sampler's engine core
    # in a process of its own) would outlive it. This one ends the server's run; the process, its job closed, then
    # ends by the signal, as a supervisor expects.
    signal.signal(signal.SIGTERM, _stop)
    stopped_by = None
    try:
        server.run(sockets=[listener])
    except _Stopped as stopped:
        stopped_by = stopped.signum
    finally:
        close_job(server)
    if stopped_by is not None:
        signal.signal(stopped_by, signal.SIG_DFL)
        signal.raise_signal(stopped_by)
    return 0


def _bound(host: str, port: int) -> socket.socket:
    """The server's address, bound before its job loads (a minute or more): a port in use is refused at once, not
    after the load, and nothing started meanwhile (the job's engine core and Ray take ports the kernel picks) can
    take it. Connections are refused until the server listens, once the job has loaded."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise SystemExit(f"--port {port}: {host}:{port} cannot be bound ({err.strerror})") from None
    return sock


class _Stopped(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame) -> None:
    raise _Stopped(signum)
