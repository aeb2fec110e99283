"""Profiles per card (``labkit.course.profile``), chosen from mocked CUDA device properties: no GPU, a 16 GB T4,
a 24 GB L4, an 80 GB H100, a 141 GB H200 and a shared card; notebook 04's largest sweep fits each card; and the
table in notebook 00 says what ``pick_profile`` does (every row checked against the function)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from labkit.core.model.presets import PRESETS
from labkit.course.profile import (
    CARD_CLASSES,
    GB,
    GPU_MODEL,
    MEMORY_SHARE,
    SWEEP_DECODE_STEPS,
    SWEEP_PROMPT_LEN,
    Profile,
    card_class,
    gpu_profile,
    pick_profile,
    sweep_bytes,
)

NOTEBOOK_00 = Path(__file__).resolve().parents[2] / "notebooks" / "00_setup_and_hardware.ipynb"


def mock_card(monkeypatch: pytest.MonkeyPatch, total: float, capability: tuple[int, int], used_elsewhere: float = 0,
              name: str = "card") -> None:
    props = SimpleNamespace(name=name, total_memory=int(total), major=capability[0], minor=capability[1])
    context = 0.5 * GB  # the CUDA context's own share, never free
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(total - context - used_elsewhere),
                                                                         int(total)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)


CUDA = torch.device("cuda")  # a torch.device is taken as given: no availability check, nothing touches a GPU


def test_no_gpu() -> None:
    profile = pick_profile("cpu", smoke=False)
    assert (profile.name, profile.device, profile.card, profile.engine_model) == ("cpu", "cpu", "none", "labkit-tiny")


@pytest.mark.parametrize(("card", "total", "capability", "want"), [
    ("T4", 15.8e9, (7, 5), ("16 GB", "float16", 64, 256)),
    ("L4", 23.7e9, (8, 9), ("24 GB", "bfloat16", 128, 256)),
    ("H100 80GB", 85.0e9, (9, 0), ("80 GB", "bfloat16", 512, 256)),
    ("H200", 150.1e9, (9, 0), ("141 GB+", "bfloat16", 1024, 256)),
])
def test_cards(monkeypatch: pytest.MonkeyPatch, card: str, total: float, capability: tuple[int, int],
               want: tuple[str, str, int, int]) -> None:
    mock_card(monkeypatch, total, capability, name=card)
    profile = pick_profile(CUDA, smoke=False)
    assert (profile.card, profile.dtype, profile.max_batch, profile.num_requests) == want
    assert profile.name == "gpu" and profile.device == "cuda" and not profile.smoke
    assert profile.engine_model == profile.perf_model == GPU_MODEL  # a ~1B preset for 01 and 06-09 on every GPU
    assert profile.model == "labkit-tiny"  # text to read stays the trained model


def test_a_shared_card_is_classed_by_what_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    mock_card(monkeypatch, 85.0e9, (9, 0), used_elsewhere=60e9)  # another job holds 60 GB of an H100
    assert pick_profile(CUDA, smoke=False).card == "24 GB"


def test_smoke_mode_wins_on_any_card(monkeypatch: pytest.MonkeyPatch) -> None:
    mock_card(monkeypatch, 150.1e9, (9, 0))
    profile = pick_profile(CUDA, smoke=True)
    assert profile.smoke and profile.name == "smoke" and profile.dtype == "bfloat16"
    assert profile.engine_model == "labkit-tiny" and profile.max_batch == 4


@pytest.mark.parametrize("card", CARD_CLASSES, ids=[c.name for c in CARD_CLASSES])
def test_notebook_04_sweep_fits_the_card(card) -> None:  # type: ignore[no-untyped-def]
    """The largest (batch, prompt) of notebook 04's sweep fits the smallest card of its class, with room to spare;
    twice the batch would not (so the sweep uses what the card offers)."""
    profile = gpu_profile(card.min_memory, (8, 0))
    config = PRESETS[profile.perf_model]
    need = sweep_bytes(config, profile.max_batch, SWEEP_PROMPT_LEN, SWEEP_DECODE_STEPS, 2)
    assert need <= MEMORY_SHARE * card.min_memory
    if profile.max_batch < 1024:
        assert sweep_bytes(config, 2 * profile.max_batch, SWEEP_PROMPT_LEN, SWEEP_DECODE_STEPS, 2) > \
            MEMORY_SHARE * card.min_memory


def test_classes_are_ordered_and_small_cards_get_the_first() -> None:
    assert [c.min_memory for c in CARD_CLASSES] == sorted(c.min_memory for c in CARD_CLASSES)
    assert card_class(6 * GB) is CARD_CLASSES[0] and card_class(10**15) is CARD_CLASSES[-1]


def notebook_table() -> dict[str, dict[str, str]]:
    """Notebook 00's profile table: first column -> {header: cell}."""
    nb = json.loads(NOTEBOOK_00.read_text(encoding="utf-8"))
    text = next("".join(c["source"]) for c in nb["cells"]
                if c["cell_type"] == "markdown" and "## 4. The model profile" in "".join(c["source"]))
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("|")]
    header, body = rows[0], rows[2:]
    return {r[0]: dict(zip(header, r)) for r in body}


def check_row(row: dict[str, str], profile: Profile) -> None:
    for field in ("model", "engine_model", "perf_model", "max_batch", "num_requests"):
        assert row[f"`{field}`"] == str(getattr(profile, field)), (row["where"], field)


def test_notebook_00_table_matches_the_function(monkeypatch: pytest.MonkeyPatch) -> None:
    table = notebook_table()
    assert set(table) == {"smoke mode (any device)", "CPU", "Apple MPS"} | {f"CUDA {c.name}" for c in CARD_CLASSES}
    check_row(table["smoke mode (any device)"], pick_profile("cpu", smoke=True))
    check_row(table["CPU"], pick_profile("cpu", smoke=False))
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    check_row(table["Apple MPS"], pick_profile("mps", smoke=False))
    for card, upper in zip(CARD_CLASSES, [c.min_memory for c in CARD_CLASSES[1:]] + [None]):
        row = table[f"CUDA {card.name}"]
        assert card.examples == row["for example"]
        memory = row["usable GPU memory"]
        lower = f"{card.min_memory // GB}" if card is not CARD_CLASSES[0] else None
        if upper is None:
            assert memory == f"from {lower} GB"
        elif lower is None:
            assert memory == f"under {upper // GB} GB"
        else:
            assert memory == f"{lower}–{upper // GB} GB"
        for capability, dtype in (((8, 0), "bfloat16"), ((7, 0), "float16")):
            mock_card(monkeypatch, card.min_memory + 0.5 * GB, capability)  # the context's share comes back as free
            profile = pick_profile(CUDA, smoke=False)
            assert profile.card == card.name and profile.dtype == dtype
            assert row["dtype"] == "bfloat16 (float16 before 8.0)"
            check_row(row, profile)
