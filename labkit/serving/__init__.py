"""Serving under load (notebook 09): an async engine, an OpenAI-compatible server, and its launchers.

    from labkit.serving import ServerProcess
    with ServerProcess(engine="chunked") as server:      # python -m labkit.serving, on 127.0.0.1
        print(server.base_url)                           # point the openai client or labkit.measure.loadgen at it

Modules: ``async_engine`` (AsyncLLM: the engine loop in a background thread), ``protocol`` (request
validation), ``limits`` (what a request may cost: body size, JSON shape, Unicode, prompt length before
tokenizing), ``api_server`` (the FastAPI app), ``responses`` (response shapes and streams that always end),
``security`` (browser protection: Host, Origin, content type), ``connections`` (read timeouts for slow clients,
the connection cap), ``openapi`` (the routes' schemas at ``/openapi.json``), ``shutdown`` (graceful shutdown and exit
codes), ``cli`` (``python -m labkit.serving``), ``launcher`` (start and stop a server from a notebook or a test).
"""

from labkit.serving.api_server import build_app
from labkit.serving.async_engine import AsyncLLM, EngineDeadError, TokenDelta
from labkit.serving.cli import ServerConfig, run_server
from labkit.serving.launcher import ServerProcess, ServerThread
from labkit.serving.prometheus import EngineState, ServerMetrics
from labkit.serving.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from labkit.serving.security import AccessPolicy

__all__ = [
    "AccessPolicy",
    "AsyncLLM",
    "ChatCompletionRequest",
    "CompletionRequest",
    "EngineDeadError",
    "EngineState",
    "RequestError",
    "ServerConfig",
    "ServerMetrics",
    "ServerProcess",
    "ServerThread",
    "TokenDelta",
    "build_app",
    "run_server",
]
