"""Security defaults: a checkpoint folder's own Python code (``auto_map``) and pickle weights never run, an
unknown model type is refused, and no error message, log line or progress bar repeats a prompt (prompts may
hold secrets), also when a step fails.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from labkit import LLM
from labkit.core.llm import RequestFailedError

from .reliability_common import PROMPTS, Fault, greedy, make


def evil_folder(tmp_path: Path, source: Path) -> Path:
    """A checkpoint folder that would run code (and leave marker files) if anything executed its contents."""
    folder = tmp_path / "ckpt"
    shutil.copytree(source, folder)
    marker = tmp_path / "pwned"
    (folder / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    for name, cls in (("evil_model", "AutoModelForCausalLM"), ("evil_tok", "AutoTokenizer")):
        (folder / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('{name}')\n")
        config_name = "config.json" if cls.startswith("AutoModel") else "tokenizer_config.json"
        config = json.loads((folder / config_name).read_text())
        config["auto_map"] = {cls: f"{name}.Evil" if cls.startswith("AutoModel") else [f"{name}.Evil", None]}
        (folder / config_name).write_text(json.dumps(config))
    return folder


def test_remote_code_and_pickles_never_run(tmp_path: Path, tiny: Path) -> None:
    folder = evil_folder(tmp_path, tiny)
    marker = tmp_path / "pwned"
    llm = LLM(str(folder), engine="chunked")  # labkit's own model code, weights from safetensors only
    assert len(llm.generate(PROMPTS[0], greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"only pickle checkpoint files \(pytorch_model.bin\).*safetensors"):
        LLM(str(folder), engine="naive")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evil"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="evil"):
        LLM(str(folder), engine="naive")
    assert not marker.exists()


def test_errors_and_failures_never_echo_the_prompt(tiny: Path, caplog: pytest.LogCaptureFixture,
                                                    capfd: pytest.CaptureFixture[str]) -> None:
    """Prompts may hold secrets: no log line, progress bar or error message repeats them."""
    secret = "my password is hunter2-SECRET"
    llm = make(tiny, "chunked", max_model_len=64)
    caplog.set_level("DEBUG")
    messages = []
    for prompt, params in ((secret * 20, greedy(2)), (secret, greedy(60))):
        with pytest.raises(ValueError) as info:
            llm.generate(prompt, params)
        messages.append(str(info.value))
    llm.engine.fault_hook = Fault(at=2, error=RuntimeError("boom"))
    with pytest.raises(RequestFailedError) as failed:
        llm.generate([secret, "Hello"], greedy(4))
    messages.append(str(failed.value))
    out, err = capfd.readouterr()
    for text in [*messages, out, err, caplog.text]:
        assert "hunter2" not in text
