"""Browser protection by default (issue 19): a web page in the learner's browser must not drive the server.
Bodies that are not ``application/json`` get a 415 (a page can send ``text/plain`` cross-origin without a
preflight), a ``Host`` that does not name the server a 403 (DNS rebinding), an ``Origin`` that is not
allowed a 403; the options open it up; labkit's own clients (the notebook's) pass untouched."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from labkit.measure.loadgen import RandomDataset, ServeBenchConfig, benchmark_serving
from labkit.serving import ServerThread
from labkit.serving.cli import parse_args
from labkit.serving.security import AccessPolicy, parse_list_option

MODEL = "labkit-tiny"
BODY = b'{"model": "labkit-tiny", "prompt": "Once upon a time", "max_tokens": 2}'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(model=MODEL, engine="chunked", max_model_len=128) as srv:
        yield srv


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerThread]:
    options = {"allowed_hosts": ("llm.lab.example", ".cluster.example"),
               "allowed_origins": ("http://localhost:3000",)}
    with ServerThread(model=MODEL, engine="chunked", max_model_len=128, server_options=options) as srv:
        yield srv


def post(srv: ServerThread, headers: dict[str, str], body: bytes = BODY, path: str = "/v1/completions"
         ) -> httpx.Response:
    return httpx.post(srv.base_url + path, content=body, headers=headers, timeout=30)


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "application/jsonx", "application/json-seq"])
def test_bodies_that_are_not_json_get_a_415(server: ServerThread, content_type: str | None) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    r = post(server, headers)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["param"] == "Content-Type" and "send Content-Type: application/json" in error["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_bodies_pass(server: ServerThread, content_type: str) -> None:
    assert post(server, {"content-type": content_type}).status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "llm.lab.example", "10.1.2.3"])
def test_a_host_that_does_not_name_the_server_gets_a_403(server: ServerThread, host: str) -> None:
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/health")):
        r = httpx.request(method, server.base_url + path, content=BODY if method == "POST" else None,
                          headers={"host": host, "content-type": "application/json"}, timeout=30)
        assert r.status_code == 403, (method, path, r.text)
        error = r.json()["error"]
        assert error["param"] == "Host" and "--allowed-hosts" in error["message"]


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:8000", "127.0.0.1", "127.0.0.2:1234", "[::1]:8000", "[::1]",
                                  "localhost.", "[::ffff:127.0.0.1]"])
def test_loopback_hosts_pass(server: ServerThread, host: str) -> None:
    r = post(server, {"host": host, "content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_a_request_without_host_is_refused(server: ServerThread) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 403") and b'"param":"Host"' in reply.replace(b" ", b"")


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://localhost:3000", "https://127.0.0.1",
                                    "http://127.0.0.1:1"])
def test_an_origin_that_is_not_allowed_gets_a_403(server: ServerThread, origin: str) -> None:
    r = post(server, {"origin": origin, "content-type": "application/json"})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["param"] == "Origin" and "--allowed-origins" in error["message"]
    preflight = httpx.options(server.base_url + "/v1/completions", timeout=30,
                              headers={"origin": origin, "access-control-request-method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers


def test_a_page_the_server_served_itself_is_same_origin(server: ServerThread) -> None:
    assert post(server, {"origin": server.base_url, "content-type": "application/json"}).status_code == 200


def test_the_options_open_it_up(open_server: ServerThread) -> None:
    for host in ("llm.lab.example", "llm.lab.example:8000", "node1.cluster.example", "cluster.example", "127.0.0.1"):
        assert post(open_server, {"host": host, "content-type": "application/json"}).status_code == 200, host
    for host in ("evil.example", "evilcluster.example"):
        assert post(open_server, {"host": host, "content-type": "application/json"}).status_code == 403
    allowed = {"origin": "http://localhost:3000", "content-type": "application/json"}
    r = post(open_server, allowed)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    preflight = httpx.options(open_server.base_url + "/v1/completions", timeout=30,
                              headers={"origin": "http://localhost:3000", "access-control-request-method": "POST",
                                       "access-control-request-headers": "content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert post(open_server, {"origin": "http://evil.example", "content-type": "application/json"}).status_code == 403
    assert post(open_server, {**allowed, "content-type": "text/plain"}).status_code == 415  # still JSON only


def test_the_notebook_clients_pass(server: ServerThread) -> None:
    """The openai client, httpx's json=, and labkit's load generator send JSON, a loopback Host and no Origin."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=2).usage.completion_tokens == 2
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=2)
    assert chat.choices[0].message.content is not None
    assert httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1},
                      timeout=30).status_code == 200
    result = benchmark_serving(ServeBenchConfig(base_url=server.base_url, dataset=RandomDataset(8, 4, 0.0),
                                                num_prompts=3, ignore_eos=True))
    assert result.metrics.completed == 3


def test_options_parse_and_policy() -> None:
    config = parse_args(["--allowed-origins", '["http://localhost:3000", "https://lab.example"]',
                         "--allowed-hosts", "a.example,b.example"])
    assert config.allowed_origins == ("http://localhost:3000", "https://lab.example")
    assert config.access == AccessPolicy("127.0.0.1", ("a.example", "b.example"), config.allowed_origins)
    assert parse_args([]).access == AccessPolicy()  # default: this machine only, no browser origins
    assert parse_list_option("*") == ("*",) and AccessPolicy(allowed_hosts=("*",)).host_allowed("anything.example")
    assert AccessPolicy(bind_host="192.168.1.5").host_allowed("192.168.1.5:8000")
    assert not AccessPolicy(bind_host="0.0.0.0").host_allowed("0.0.0.0")  # a wildcard bind names no host
    assert AccessPolicy(allowed_origins=("*",)).origin_allowed("http://any.example", "127.0.0.1:8000")


@pytest.mark.parametrize("host, allowed", [
    ("localhost:8000", True), ("127.0.0.1", True), ("[::1]:8000", True), ("LOCALHOST.", True),
    ("[::ffff:127.0.0.1]:80", True),
    ("localhost:80@evil.com", False),  # userinfo-like tricks: not a host[:port], so no loose reading admits it
    ("[::1]evil.com", False), ("localhost:8000/x", False), ("localhost:abc", False), ("evil.com", False),
    ("localhost evil.com", False),
    # IPv6 literals: only an IPv6 address in brackets, then an optional port in range
    ("[0:0:0:0:0:0:0:1]:80", True), ("[::1]:", True), ("[::ffff:7f00:1]", True), ("[::2]", False),
    ("::1", False), ("::1:8000", False), ("[::1", False), ("::1]", False), ("[[::1]]", False), ("[::1]:8000:1", False),
    ("[::1]:99999", False), ("[127.0.0.1]", False), ("[::1%25lo]", False), ("[v1.x]", False), ("[::1]:+80", False),
    ("[::1]@evil.com", False), ("[::1]:80@evil.com", False), ("[fe80::1]", False),
])
def test_the_host_header_is_parsed_strictly(host: str, allowed: bool) -> None:
    assert AccessPolicy().host_allowed(host) is allowed
    assert AccessPolicy(bind_host="fe80::1").host_allowed("[fe80::1]:8000")  # an IPv6 bind names itself
