"""Where a model comes from: the bundled checkpoint, a checkpoint folder, or a preset.

Introduced in notebook 00 (``00_setup_and_hardware``), where the learner picks a model profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from labkit.core.model.config import ModelConfig
from labkit.core.model.presets import PRESETS

BUNDLED_MODEL = "labkit-tiny"
DATA_DIR = Path(__file__).resolve().parents[3] / "data"


def bundled_model_path() -> Path:
    """The folder of the small Llama model that ships with the workbook."""
    return DATA_DIR / BUNDLED_MODEL


@dataclass(frozen=True)
class ModelSource:
    """A resolved ``model`` argument: a checkpoint folder, or a preset with random weights."""

    name: str
    config: ModelConfig
    checkpoint: Path | None  # None for presets
    tokenizer_path: Path  # presets borrow the bundled tokenizer (their vocab is larger, so ids stay valid)

    @property
    def is_preset(self) -> bool:
        return self.checkpoint is None


def resolve_model_source(model: str | Path) -> ModelSource:
    """Turn ``LLM(model=...)`` into a source; unknown names get an error listing what exists."""
    if isinstance(model, str) and model == BUNDLED_MODEL:
        model = bundled_model_path()
    if isinstance(model, str) and model in PRESETS:
        return ModelSource(model, PRESETS[model], None, bundled_model_path())
    if not str(model).strip():  # Path("") is ".", the current folder: never what was meant
        raise ValueError(f"model is empty; give the bundled model {BUNDLED_MODEL!r}, a checkpoint folder, or a preset "
                         f"({', '.join(PRESETS)})")
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path.resolve()} has no config.json; a checkpoint folder needs config.json and *.safetensors"
            )
        return ModelSource(path.name, ModelConfig.from_json_file(path / "config.json"), path, path)
    raise ValueError(
        f"unknown model {str(model)!r}: not a folder, not the bundled model {BUNDLED_MODEL!r}, and not a preset "
        f"({', '.join(PRESETS)})"
    )
