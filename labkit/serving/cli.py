"""``python -m labkit.serving``: load a model, start the engine thread, serve the app with uvicorn.

    python -m labkit.serving --model labkit-tiny --engine chunked --port 8000 --max-num-batched-tokens 256
    python -m labkit.serving --quantization int8 --kv-cache-dtype int8       # 8-bit weights and KV (notebook 14)

Binds 127.0.0.1 unless ``--host`` says otherwise (and warns then: the server has no authentication).
``--port 0`` takes any free port; the ready line printed once the socket is bound says which, and
``labkit.serving.launcher`` waits for it. Browser protection (``--allowed-hosts``, ``--allowed-origins``),
the body limit and graceful shutdown: see ``labkit.serving.security`` and ``labkit.serving.shutdown``; the
exit code is 0 after a clean shutdown, 2 when the server cannot start, 3 when running requests had to be
ended. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

from labkit.core.kv.quantized_pool import KV_CACHE_DTYPES, check_kv_cache_dtype
from labkit.core.llm import LLM
from labkit.core.model.source import BUNDLED_MODEL
from labkit.core.quant.config import QUANTIZATION_METHODS, resolve_quantization
from labkit.serving.api_server import build_app
from labkit.serving.async_engine import HAND_OFFS, AsyncLLM
from labkit.serving.connections import (
    DEFAULT_LIMIT_CONCURRENCY,
    DEFAULT_TIMEOUT_BODY_STALL,
    DEFAULT_TIMEOUT_REQUEST_HEADER,
    ConnectionLimits,
    protocol_class,
)
from labkit.serving.prometheus import ServerMetrics
from labkit.serving.security import AccessPolicy, parse_list_option
from labkit.serving.shutdown import EXIT_CANNOT_START, EXIT_OK, EXIT_REQUESTS_ENDED, GracefulServer
from labkit.serving.timings import ServerTimings

READY_LINE = "labkit.serving listening on"  # printed once the socket is bound; launchers wait for it


@dataclass
class ServerConfig:
    """How to start a server: the model, its engine and options, where to listen. Notebook 09."""

    model: str = BUNDLED_MODEL
    engine: str | None = None  # None: LLM's default ("chunked")
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (the ready line says which)
    served_model_name: str | None = None  # default: the model argument
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    quantization: str | None = None  # None, "int8" or "int4": weight-only quantization at load (notebook 14)
    engine_options: dict[str, Any] = field(default_factory=dict)
    log_level: str = "warning"
    access_log: bool = False
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides localhost, loopback and `host`
    allowed_origins: tuple[str, ...] = ()  # browser pages allowed to call the server (vLLM's option)
    max_request_body_bytes: int | None = None  # None: labkit.serving.limits.default_max_request_body_bytes
    timeout_graceful_shutdown: float = 5.0  # seconds running requests get to finish on SIGINT/SIGTERM
    # A slow client's bounds (labkit.serving.connections): the request head within this many seconds, no gap in a
    # body longer than this, at most this many open connections (a 503 beyond), idle keep-alive closed after this.
    timeout_request_header: float = DEFAULT_TIMEOUT_REQUEST_HEADER
    timeout_body_stall: float = DEFAULT_TIMEOUT_BODY_STALL
    limit_concurrency: int = DEFAULT_LIMIT_CONCURRENCY
    timeout_keep_alive: float = 5.0  # uvicorn's default
    record_timings: bool = False  # add up where the server's time goes; GET /timings (labkit.serving.timings)
    hand_off: str = "per_token"  # how a step's tokens reach the event loop (AsyncLLM's hand_off)
    stream_coalesce: bool = False  # a lagging stream's waiting tokens go out as one event (AsyncLLM's coalesce)

    @property
    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.timeout_request_header, self.timeout_body_stall, self.limit_concurrency)

    @property
    def access(self) -> AccessPolicy:
        return AccessPolicy(self.host, tuple(self.allowed_hosts), tuple(self.allowed_origins))


def make_async_llm(config: ServerConfig) -> AsyncLLM:
    llm = LLM(config.model, engine=config.engine, device=config.device, dtype=config.dtype, seed=config.seed,
              quantization=config.quantization, **config.engine_options)
    return AsyncLLM(llm, ServerMetrics(config.served_model_name or config.model),
                    timings=ServerTimings() if config.record_timings else None, hand_off=config.hand_off,
                    coalesce=config.stream_coalesce)


def bind_socket(host: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def uvicorn_server(app: FastAPI, config: ServerConfig) -> GracefulServer:
    async_llm: AsyncLLM = app.state.async_llm
    uv_config = uvicorn.Config(app, log_level=config.log_level, access_log=config.access_log, lifespan="off",
                               http=protocol_class(config.connection_limits),
                               timeout_keep_alive=config.timeout_keep_alive)
    return GracefulServer(uv_config, app.state.active_requests, lambda reason: async_llm.shutdown(reason=reason),
                          config.timeout_graceful_shutdown)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_server(config: ServerConfig) -> int:
    """Bind (first: a taken port fails fast), load the model, print the ready line, serve until SIGINT/SIGTERM.
    Returns the exit code: 0 if every request finished, 3 if running ones had to be ended."""
    sock = bind_socket(config.host, config.port)
    try:
        async_llm = make_async_llm(config).start()
    except BaseException:
        sock.close()
        raise
    # The model, tokenizer and libraries are hundreds of thousands of objects that live as long as the server.
    # Frozen, the garbage collector stops walking them on every full collection: a request that allocates
    # many objects (a 100k-item JSON list) then triggers collections of milliseconds, not half-second pauses
    # during which no thread, the event loop included, runs.
    gc.collect()
    gc.freeze()
    name = config.served_model_name or config.model
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    if not _is_loopback(config.host):
        print(f"WARNING: listening on {config.host}, reachable from other machines; this server has no "
              "authentication. Clients must use a name in --allowed-hosts", file=sys.stderr)
    print(f"{READY_LINE} http://{host}:{port} (model {name!r}, {async_llm.llm!r})", flush=True)
    app = build_app(async_llm, name, config.access, config.max_request_body_bytes)
    server = uvicorn_server(app, config)
    try:
        server.run(sockets=[sock])
    finally:
        async_llm.shutdown()
    ended = f"{server.num_ended} running request(s) ended after the grace period" if server.num_ended \
        else "every request finished"
    print(f"labkit.serving stopped{f' on {server.signal_name}' if server.signal_name else ''}: {ended}",
          file=sys.stderr, flush=True)
    return EXIT_REQUESTS_ENDED if server.num_ended else EXIT_OK


def _port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535] (0: any free port), got {port}")
    return port


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {number}")
    return number


def _seconds(value: str) -> float:
    number = float(value)
    if not number >= 0 or number == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return number


def _positive_seconds(value: str) -> float:
    number = _seconds(value)
    if number == 0:
        raise argparse.ArgumentTypeError("must be a number of seconds > 0")
    return number


def _quantization(value: str) -> str:
    try:
        resolve_quantization(value)  # the engine's own check, so the message is the one LLM(...) gives
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _kv_cache_dtype(value: str) -> str:
    try:
        return check_kv_cache_dtype(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = argparse.ArgumentParser(prog="python -m labkit.serving", description="labkit's OpenAI-compatible server")
    p.add_argument("--model", default=BUNDLED_MODEL, help="bundled model name, checkpoint folder or preset")
    p.add_argument("--engine", default=None, help="engine name (default: chunked)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="port (0: any free port)")
    p.add_argument("--allowed-hosts", type=parse_list_option, default=(),
                   help="Host names clients use besides localhost and loopback addresses, as a JSON list or "
                        "comma-separated ('*': any); refusing others guards against DNS rebinding")
    p.add_argument("--allowed-origins", type=parse_list_option, default=(),
                   help="browser origins allowed to call the server, e.g. '[\"http://localhost:3000\"]' ('*': any); "
                        "default none")
    p.add_argument("--max-request-body-bytes", type=_positive_int, default=None,
                   help="larger bodies get a 413 (default 4 MiB, or 32 bytes per token of max_model_len)")
    p.add_argument("--timeout-graceful-shutdown", type=_seconds, default=5.0,
                   help="seconds running requests get to finish on SIGINT/SIGTERM (default 5)")
    p.add_argument("--timeout-request-header", type=_positive_seconds, default=DEFAULT_TIMEOUT_REQUEST_HEADER,
                   help="seconds a client has to send a request's line and headers; then 408 and closed "
                        f"(default {DEFAULT_TIMEOUT_REQUEST_HEADER:g})")
    p.add_argument("--timeout-body-stall", type=_positive_seconds, default=DEFAULT_TIMEOUT_BODY_STALL,
                   help="longest gap in a request body's bytes; then the connection is closed "
                        f"(default {DEFAULT_TIMEOUT_BODY_STALL:g})")
    p.add_argument("--limit-concurrency", type=_positive_int, default=DEFAULT_LIMIT_CONCURRENCY,
                   help=f"open connections at most; beyond, a 503 (default {DEFAULT_LIMIT_CONCURRENCY})")
    p.add_argument("--timeout-keep-alive", type=_positive_seconds, default=5.0,
                   help="seconds an idle kept-alive connection stays open (default 5)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model'")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantization", type=_quantization, default=None,
                   help=f"weight-only quantization of every linear layer at load: {' or '.join(QUANTIZATION_METHODS)} "
                        "(int4: groups of 32 inputs); default none (the model's dtype)")
    p.add_argument("--kv-cache-dtype", type=_kv_cache_dtype, default="auto",
                   help=f"the KV cache's format: {', '.join(KV_CACHE_DTYPES)} (default auto: the model's dtype)")
    for opt in ("max-model-len", "max-num-seqs", "max-num-batched-tokens", "block-size", "num-gpu-blocks"):
        p.add_argument(f"--{opt}", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="plan the next step while the current one runs (engines continuous and chunked)")
    # Pluggable parts (vLLM's names): import paths of your classes, e.g. --scheduler-cls mymodule.MyScheduler
    p.add_argument("--scheduler-cls", default=None, help="a labkit Scheduler subclass, as module.Class")
    p.add_argument("--block-manager-cls", default=None, help="a labkit BlockManager subclass, as module.Class")
    p.add_argument("--attention-backend", default=None,
                   help="a name in labkit.ATTENTION_BACKENDS, or a PagedAttentionBackend subclass as module.Class")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads for the engine")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--hand-off", type=lambda v: v.replace("-", "_"), choices=HAND_OFFS, default="per_token",
                   help="a step's tokens reach the event loop one wake-up each (per-token) or all in one (per-step)")
    p.add_argument("--stream-coalesce", action=argparse.BooleanOptionalAction, default=False,
                   help="send the tokens waiting for a stream that fell behind as one event (as vLLM does)")
    p.add_argument("--record-timings", action="store_true",
                   help="add up the server's time per part (parse, tokenize, engine step, framing, ...): GET /timings")
    a = p.parse_args(argv)
    options = {k: getattr(a, k) for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                          "num_gpu_blocks", "scheduler_cls", "block_manager_cls", "attention_backend")
               if getattr(a, k) is not None}
    if a.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = a.kv_cache_dtype
    if a.enable_prefix_caching:
        options["enable_prefix_caching"] = True
    if a.async_scheduling:
        options["async_scheduling"] = True
    if a.num_threads is not None:
        import torch

        torch.set_num_threads(a.num_threads)
    return ServerConfig(model=a.model, engine=a.engine, host=a.host, port=a.port,
                        served_model_name=a.served_model_name, device=a.device, dtype=a.dtype, seed=a.seed,
                        quantization=a.quantization, engine_options=options, log_level=a.log_level,
                        access_log=a.access_log,
                        allowed_hosts=a.allowed_hosts, allowed_origins=a.allowed_origins,
                        max_request_body_bytes=a.max_request_body_bytes,
                        timeout_graceful_shutdown=a.timeout_graceful_shutdown, record_timings=a.record_timings,
                        timeout_request_header=a.timeout_request_header, timeout_body_stall=a.timeout_body_stall,
                        limit_concurrency=a.limit_concurrency, timeout_keep_alive=a.timeout_keep_alive,
                        hand_off=a.hand_off, stream_coalesce=a.stream_coalesce)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        code = run_server(config)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:  # bad option, unknown model, port taken
        print(f"labkit.serving: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CANNOT_START)
    except KeyboardInterrupt:  # Ctrl-C while the model loads
        print("labkit.serving: interrupted while starting", file=sys.stderr)
        sys.exit(EXIT_CANNOT_START)
    sys.exit(code)
