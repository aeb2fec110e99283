"""``python -m labkit.serving``: load a model, start the engine thread, serve the app with uvicorn.

    python -m labkit.serving --model labkit-tiny --engine chunked --port 8000 --max-num-batched-tokens 256

Binds 127.0.0.1 unless ``--host`` says otherwise (and warns then: the server has no authentication).
``--port 0`` takes any free port; the ready line printed once the socket is bound says which, and
``labkit.serving.launcher`` waits for it. Introduced in notebook 09 (``09_serving_and_metrics``).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

from labkit.llm import LLM
from labkit.metrics.prometheus import ServerMetrics
from labkit.model.source import BUNDLED_MODEL
from labkit.serving.api_server import build_app
from labkit.serving.async_engine import AsyncLLM

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
    engine_options: dict[str, Any] = field(default_factory=dict)
    log_level: str = "warning"
    access_log: bool = False


def make_async_llm(config: ServerConfig) -> AsyncLLM:
    llm = LLM(config.model, engine=config.engine, device=config.device, dtype=config.dtype, seed=config.seed,
              **config.engine_options)
    return AsyncLLM(llm, ServerMetrics(config.served_model_name or config.model))


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def uvicorn_server(app: FastAPI, config: ServerConfig) -> uvicorn.Server:
    return uvicorn.Server(uvicorn.Config(app, log_level=config.log_level, access_log=config.access_log,
                                         timeout_graceful_shutdown=5, lifespan="off"))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_server(config: ServerConfig) -> None:
    """Bind (first: a taken port fails fast), load the model, print the ready line, serve until SIGINT/SIGTERM."""
    sock = bind_socket(config.host, config.port)
    try:
        async_llm = make_async_llm(config).start()
    except BaseException:
        sock.close()
        raise
    name = config.served_model_name or config.model
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    if not _is_loopback(config.host):
        print(f"WARNING: listening on {config.host}, reachable from other machines; this server has no "
              "authentication", file=sys.stderr)
    print(f"{READY_LINE} http://{host}:{port} (model {name!r}, {async_llm.llm!r})", flush=True)
    try:
        uvicorn_server(build_app(async_llm, name), config).run(sockets=[sock])
    finally:
        async_llm.shutdown()


def parse_args(argv: list[str] | None = None) -> ServerConfig:
    p = argparse.ArgumentParser(prog="python -m labkit.serving", description="labkit's OpenAI-compatible server")
    p.add_argument("--model", default=BUNDLED_MODEL, help="bundled model name, checkpoint folder or preset")
    p.add_argument("--engine", default=None, help="engine name (default: chunked)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as 'model'")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
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
    a = p.parse_args(argv)
    options = {k: getattr(a, k) for k in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                                          "num_gpu_blocks", "scheduler_cls", "block_manager_cls", "attention_backend")
               if getattr(a, k) is not None}
    if a.enable_prefix_caching:
        options["enable_prefix_caching"] = True
    if a.async_scheduling:
        options["async_scheduling"] = True
    if a.num_threads is not None:
        import torch

        torch.set_num_threads(a.num_threads)
    return ServerConfig(model=a.model, engine=a.engine, host=a.host, port=a.port,
                        served_model_name=a.served_model_name, device=a.device, dtype=a.dtype, seed=a.seed,
                        engine_options=options, log_level=a.log_level, access_log=a.access_log)


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    try:
        run_server(config)
    except (ValueError, TypeError, FileNotFoundError, OSError) as exc:  # bad option, unknown model, port taken
        print(f"labkit.serving: error: {exc}", file=sys.stderr)
        sys.exit(2)
