"""The server's --quantization and --kv-cache-dtype flags: parsed into the config, passed to LLM, bad values refused
with the engine's own message (nothing is loaded or started here)."""

from __future__ import annotations

import pytest

from labkit.serving import cli
from labkit.serving.cli import ServerConfig, make_async_llm, parse_args


def test_defaults_leave_weights_and_kv_cache_in_the_models_dtype() -> None:
    config = parse_args([])
    assert config.quantization is None and "kv_cache_dtype" not in config.engine_options


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_flags_reach_the_config(method: str, kv: str) -> None:
    config = parse_args(["--quantization", method, "--kv-cache-dtype", kv, "--max-model-len", "64"])
    assert config.quantization == method
    assert config.engine_options == {"kv_cache_dtype": kv, "max_model_len": 64}
    assert parse_args(["--kv-cache-dtype", "auto"]).engine_options == {}  # "auto": the engine's default, unsent


@pytest.mark.parametrize(("argv", "message"), [
    (["--quantization", "int3"], "argument --quantization: quantization='int3' is not supported; choose None "
                                 "(the model's dtype) or one of 'int8', 'int4'"),
    (["--quantization", "INT8"], "quantization='INT8' is not supported"),
    (["--kv-cache-dtype", "fp16"], "argument --kv-cache-dtype: kv_cache_dtype='fp16' is not supported; choose one "
                                   "of 'auto', 'int8', 'fp8'"),
])
def test_bad_values_exit_with_the_engines_message(argv: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2  # argparse's usage error
    assert message in capsys.readouterr().err


class Loaded(Exception):
    """Raised by the stand-in LLM: the arguments were recorded, nothing more is started."""


def test_make_async_llm_passes_both_options_to_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_llm(model: str, **kwargs: object) -> None:
        seen.update(kwargs, model=model)
        raise Loaded

    monkeypatch.setattr(cli, "LLM", fake_llm)
    with pytest.raises(Loaded):
        make_async_llm(parse_args(["--quantization", "int4", "--kv-cache-dtype", "int8"]))
    assert seen["quantization"] == "int4" and seen["kv_cache_dtype"] == "int8"
    seen.clear()
    with pytest.raises(Loaded):
        make_async_llm(ServerConfig())
    assert seen["quantization"] is None and "kv_cache_dtype" not in seen
