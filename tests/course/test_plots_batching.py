"""Static-batching accounting (labkit.measure.batching) matches the kvcache engine, and its plots draw."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from labkit import LLM  # noqa: E402
from labkit.course.plots import plot_slot_occupancy, plot_token_breakdown  # noqa: E402
from labkit.measure.batching import (  # noqa: E402
    TokenCounts,
    static_batch_occupancy,
    static_batches,
    static_batching_waste,
)
from labkit.measure.workloads import load_workload, materialise, sampling_params_for  # noqa: E402

PROMPTS, OUTPUTS = [4, 2, 10, 1, 6], [1, 3, 1, 8, 2]


def test_static_batches_are_fcfs_chunks() -> None:
    assert static_batches(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert static_batches(0, 3) == []
    with pytest.raises(ValueError, match="max_num_seqs"):
        static_batches(3, 0)


def test_occupancy_by_hand() -> None:
    occ = static_batch_occupancy(PROMPTS, OUTPUTS, max_num_seqs=2)
    # batches [4,2]/[1,3]: 1 prefill + 2 decodes; [10,1]/[1,8]: 1 + 7; [6]/[2]: 1 + 1
    assert occ.num_steps == 3 + 8 + 2 and occ.num_slots == 2
    assert occ.batch_starts == [0, 3, 11]
    assert list(np.flatnonzero(occ.prefill)) == [0, 3, 11]
    assert occ.useful[0].tolist() == [4, 2] and occ.padding[0].tolist() == [0, 2]
    assert occ.idle[1:3, 0].all() and occ.useful[1:3, 1].tolist() == [1, 1]  # row 0 finished at the prefill
    assert occ.useful[11:, 1].tolist() == [0, 0] and not occ.idle[11:, 1].any()  # the last batch has one row
    assert occ.totals() == static_batching_waste(PROMPTS, OUTPUTS, 2)
    assert sum(occ.step_counts(), TokenCounts(0, 0, 0)) == occ.totals()


def test_accounting_matches_the_kvcache_engine_step_by_step() -> None:
    wl = load_workload("heterogeneous_small_16")
    wl = dataclasses.replace(wl, requests=wl.requests[:6])
    llm = LLM("labkit-tiny", engine="kvcache", device="cpu", max_num_seqs=4)
    wl = materialise(wl, llm.tokenizer, seed=0)
    llm.generate(wl.prompts(), sampling_params_for(wl), use_tqdm=False)
    stats = llm.engine.step_stats
    occ = static_batch_occupancy(wl.prompt_lens, wl.output_lens, 4)
    assert [TokenCounts.from_step(s) for s in stats] == occ.step_counts()
    assert [s.is_prefill for s in stats] == occ.prefill.tolist()
    assert TokenCounts.from_steps(stats) == static_batching_waste(wl.prompt_lens, wl.output_lens, 4)


def test_plot_slot_occupancy_draws_steps_or_time() -> None:
    occ = static_batch_occupancy(PROMPTS, OUTPUTS, max_num_seqs=2)
    ax = plot_slot_occupancy(occ)
    assert ax.get_xlabel().startswith("engine step") and ax.get_ylabel() == "batch slot (row)"
    assert "useful" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"padding", "finished, still computed", "empty slot"} <= set(labels)
    ax = plot_slot_occupancy(occ, step_times=[0.01] * occ.num_steps, title="mine")
    assert ax.get_xlabel().endswith("(ms)") and ax.get_title() == "mine"
    assert ax.get_xlim() == pytest.approx((0.0, occ.num_steps * 10.0))
    with pytest.raises(ValueError, match="step times"):
        plot_slot_occupancy(occ, step_times=[0.01])
    plt.close("all")


def test_plot_token_breakdown_stacks_useful_padding_idle() -> None:
    counts = {str(b): static_batching_waste(PROMPTS, OUTPUTS, b) for b in (1, 2, 5)}
    ax = plot_token_breakdown(counts, xlabel="max_num_seqs")
    heights = np.array([p.get_height() for p in ax.patches]).reshape(3, 3)  # (parts, runs)
    assert heights.sum(axis=0).tolist() == [c.computed for c in counts.values()]
    assert ax.get_xlabel() == "max_num_seqs" and ax.get_ylabel() == "token positions computed"
    plt.close("all")
