"""Build a ``CausalLM`` from a checkpoint folder (safetensors only) or from a preset (random weights).

Loading never unpickles anything and never runs code from the checkpoint: only ``config.json``
(parsed as JSON) and ``*.safetensors`` (plain tensors) are read. Introduced in notebook 02.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from labkit.core.model.config import ModelConfig
from labkit.core.model.decoder import CausalLM
from labkit.core.model.layers import RotaryEmbedding

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# torch.nn.init functions nn.Linear and nn.Embedding call when built (skipped_init)
INITIALISERS = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_", "trunc_normal_", "xavier_uniform_",
                "constant_")


@contextmanager
def skipped_init() -> Iterator[None]:
    """Layers built inside keep their (meta) tensors uninitialised: every weight is loaded or drawn afterwards. An
    initialiser on the meta device would also import torch's compiler stack (torch._dynamo, triton: over a second)."""
    saved = {name: getattr(nn.init, name) for name in INITIALISERS}
    try:
        for name in INITIALISERS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


def _materialise(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 reshape: Callable[[CausalLM], None] | None = None) -> CausalLM:
    """Empty tensors of the model's shapes on ``device``, ``reshape`` applied on the meta device first (tensor
    parallelism cuts a rank's shapes there)."""
    # Build on the meta device so a 1B-parameter model is not initialised twice on the CPU.
    with torch.device("meta"), skipped_init():
        model = CausalLM(config)
    if reshape is not None:
        reshape(model)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty breaks the tie; restore it
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module._init_buffers()
    return model


def find_safetensors(path: Path) -> list[Path]:
    """The checkpoint's safetensors files, or a clear error (pickles are refused, not loaded)."""
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(
            f"{path} has only pickle checkpoint files ({', '.join(pickles)}); labkit loads weights only from "
            "*.safetensors because unpickling can run arbitrary code. Convert the checkpoint to safetensors first."
        )
    raise FileNotFoundError(f"no *.safetensors weights in {path}; "
                            "a checkpoint folder needs config.json and *.safetensors")


def load_checkpoint(path: str | Path, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """Load a Llama/Qwen2/Qwen3 checkpoint folder in Hugging Face layout."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is not a folder")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path.resolve()} has no config.json; a checkpoint folder needs config.json and "
                                "*.safetensors")
    config = ModelConfig.from_json_file(path / "config.json")
    files = find_safetensors(path)
    model = _materialise(config, device, dtype)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name not in params:
                        if "rotary_emb" not in name:  # some exports carry inv_freq; we recompute it
                            unexpected.append(name)
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.shape != params[name].shape:
                        raise ValueError(f"{file.name}: {name} has shape {tuple(tensor.shape)}, "
                                         f"config.json implies {tuple(params[name].shape)}")
                    params[name].copy_(tensor)
                    loaded.add(name)
    if config.tie_word_embeddings and "lm_head.weight" not in loaded:
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    return model.eval()


def random_model(config: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0) -> CausalLM:
    """A model of the config's shape with random weights (normal, std 0.02; norms at 1), seeded."""
    model = _materialise(config, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights appear once here
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()
