"""Every exercise checker passes labkit's reference and fails a planted bug; unfinished stubs fall back."""

from __future__ import annotations

from labkit.core.metrics import compute_latencies
from labkit.course import use_or_reference
from labkit.course.ch00_setup_and_hardware import check_attainable_flops
from labkit.course.ch01_anatomy_of_a_request import check_request_latencies
from labkit.measure.hardware import attainable_flops


def test_ch00_roofline_checker() -> None:
    assert check_attainable_flops(attainable_flops).passed
    assert not check_attainable_flops(lambda i, peak, bw: max(peak, i * bw)).passed  # planted: max, not min
    assert not check_attainable_flops(lambda i, peak, bw: min(peak, bw / max(i, 1e-9))).passed  # planted: bw / I


def test_ch01_latency_checker() -> None:
    assert check_request_latencies(compute_latencies).passed

    def tpot_over_n(arrival, times):  # type: ignore[no-untyped-def]
        lat = compute_latencies(arrival, times)
        return {"ttft": lat.ttft, "itl": lat.itl, "e2e": lat.e2e, "tpot": (lat.e2e - lat.ttft) / len(times)}

    def ttft_from_zero(arrival, times):  # type: ignore[no-untyped-def]
        lat = compute_latencies(arrival, times)
        return {"ttft": times[0], "itl": lat.itl, "e2e": lat.e2e, "tpot": lat.tpot}

    def itl_from_the_arrival(arrival, times):  # type: ignore[no-untyped-def]
        lat = compute_latencies(arrival, times)
        return {"ttft": lat.ttft, "itl": [lat.ttft, *lat.itl], "e2e": lat.e2e, "tpot": lat.tpot}

    def e2e_from_the_first_token(arrival, times):  # type: ignore[no-untyped-def]
        lat = compute_latencies(arrival, times)
        return {"ttft": lat.ttft, "itl": lat.itl, "e2e": times[-1] - times[0], "tpot": lat.tpot}

    def tpot_of_one_token_undefined(arrival, times):  # type: ignore[no-untyped-def]
        lat = compute_latencies(arrival, times)
        return {"ttft": lat.ttft, "itl": lat.itl, "e2e": lat.e2e, "tpot": (lat.e2e - lat.ttft) / (len(times) - 1)}

    for bug, field in ((tpot_over_n, "tpot="), (ttft_from_zero, "ttft="), (itl_from_the_arrival, "itl="),
                       (e2e_from_the_first_token, "e2e=")):
        result = check_request_latencies(bug)
        assert result.status == "failed" and field in result.failures[0], result.failures
    result = check_request_latencies(tpot_of_one_token_undefined)  # the single-token case: tpot is 0, no gaps
    assert result.status == "failed" and "ZeroDivisionError" in result.failures[0], result.failures


def test_unfinished_stub_falls_back_to_the_reference(capsys) -> None:
    def stub(arrival, times):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    result = check_request_latencies(stub)
    assert result.status == "not started"
    chosen = use_or_reference(result, stub, compute_latencies)
    assert chosen is compute_latencies
    assert "uses labkit's reference" in capsys.readouterr().out


def test_a_crashing_solution_is_reported_not_raised() -> None:
    result = check_request_latencies(lambda arrival, times: 1 / 0)
    assert result.status == "failed" and "ZeroDivisionError" in result.failures[0]
    assert "show_hint('01.request_latencies', 2)" in result.message()  # the staged hints, on request


def test_ch02_top_p_checker() -> None:
    import torch

    from labkit.core.sampler import apply_top_p
    from labkit.course.ch02_naive_generation import check_top_p

    assert check_top_p(apply_top_p).passed

    def drops_the_crossing_token(logits, p):  # type: ignore[no-untyped-def]
        probs, order = torch.sort(logits.softmax(-1), descending=True)
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(0, order, probs.cumsum(-1) > p)
        return logits.masked_fill(drop, float("-inf"))

    def forgets_to_unsort(logits, p):  # type: ignore[no-untyped-def]
        probs, _ = torch.sort(logits.softmax(-1), descending=True)
        return logits.masked_fill((probs.cumsum(-1) - probs) >= p, float("-inf"))

    def renormalises(logits, p):  # type: ignore[no-untyped-def]
        return apply_top_p(logits, p).log_softmax(-1)  # the kept tokens must keep their logits

    def returns_the_kept_ids(logits, p):  # type: ignore[no-untyped-def]
        return torch.isfinite(apply_top_p(logits, p)).nonzero().flatten()  # not one value per vocabulary entry

    for bug, words in ((drops_the_crossing_token, "kept"), (forgets_to_unsort, "kept"),
                       (renormalises, "surviving logits must keep their values"),
                       (returns_the_kept_ids, "expected a tensor of shape")):
        result = check_top_p(bug)
        assert result.status == "failed" and words in result.failures[0], result.failures


def test_ch03_write_kv_checker() -> None:
    import torch

    from labkit.core.kv.contiguous import write_kv
    from labkit.course.ch03_kv_cache import check_write_kv

    assert check_write_kv(write_kv).passed

    def no_transpose_back(cache, new, start):  # type: ignore[no-untyped-def]
        end = start + new.shape[1]
        cache[:, :, start:end] = new.transpose(1, 2)
        return cache[:, :, :end]

    def overwrites_from_zero(cache, new, start):  # type: ignore[no-untyped-def]
        cache[:, :, : new.shape[1]] = new.transpose(1, 2)
        return cache[:, :, : start + new.shape[1]].transpose(1, 2)

    def never_writes_the_cache(cache, new, start):  # type: ignore[no-untyped-def]
        return torch.cat([cache[:, :, :start].transpose(1, 2), new], dim=1)  # right now, lost at the next step

    def writes_to_the_end(cache, new, start):  # type: ignore[no-untyped-def]
        cache[:, :, start:] = new.transpose(1, 2)[:, :, -1:]  # fills every later column too
        return cache[:, :, : start + new.shape[1]].transpose(1, 2)

    for bug, words in ((no_transpose_back, "shape"), (overwrites_from_zero, "cached prefill followed by the new"),
                       (never_writes_the_cache, "the cache tensor itself must hold the new token"),
                       (writes_to_the_end, "and nothing beyond it")):
        result = check_write_kv(bug)
        assert result.status == "failed" and any(words in f for f in result.failures), result.failures


def test_ch03_checker_runs_the_update_inside_the_kvcache_engine() -> None:
    import torch

    from labkit.core.kv.contiguous import write_kv
    from labkit.course.ch03_kv_cache import check_write_kv

    starts: list[int] = []

    def spy(cache: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
        starts.append(start)
        return write_kv(cache, new, start)

    assert check_write_kv(spy, max_tokens=4).passed
    # 2 by-hand calls, then K and V of every layer at every step of the engine built with kv_cache_cls
    assert len(starts) > 2 and max(starts) > 5
