"""The notebook 09 checker passes labkit's reference, fails planted bugs, and reports an unstarted stub."""

from __future__ import annotations

from labkit.course import use_or_reference
from labkit.course.ch09_serving_and_metrics import check_goodput
from labkit.measure.loadgen.metrics import RequestRecord, request_goodput


def test_ch09_goodput_checker_passes_the_reference() -> None:
    result = check_goodput(request_goodput)
    assert result.passed, result.message()


def _good(r: RequestRecord, slos: dict[str, float], scale: float = 1000.0, strict: bool = False,
          tpot_of_one: float = 0.0) -> bool:
    values = {"ttft": r.ttft, "tpot": r.tpot if r.output_tokens > 1 else tpot_of_one, "e2el": r.latency}
    if strict:
        return all(values[k] < ms / scale for k, ms in slos.items())
    return all(values[k] <= ms / scale for k, ms in slos.items())


def test_ch09_goodput_checker_fails_planted_bugs() -> None:
    def strict_limit(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(r.success and _good(r, slos, strict=True) for r in records) / duration

    def counts_failed_requests(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(_good(r, slos) for r in records) / duration

    def slos_as_seconds(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(r.success and _good(r, slos, scale=1.0) for r in records) / duration

    def single_token_fails_tpot(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(r.success and _good(r, slos, tpot_of_one=float("inf")) for r in records) / duration

    def per_request_not_per_second(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(r.success and _good(r, slos) for r in records) / max(1, len(records))

    def any_slo_is_enough(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(r.success and any(_good(r, {k: v}) for k, v in slos.items()) for r in records) / duration

    def counts_good_tokens(records, slos, duration):  # type: ignore[no-untyped-def]
        return sum(r.output_tokens for r in records if r.success and _good(r, slos)) / duration

    for bug in (strict_limit, counts_failed_requests, slos_as_seconds, single_token_fails_tpot,
                per_request_not_per_second, any_slo_is_enough, counts_good_tokens):
        result = check_goodput(bug)
        assert result.status == "failed" and result.failures, bug.__name__


def test_ch09_unstarted_stub_falls_back_to_the_reference(capsys) -> None:  # type: ignore[no-untyped-def]
    def stub(records, slos, duration):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    result = check_goodput(stub)
    assert result.status == "not started"
    assert use_or_reference(result, stub, request_goodput) is request_goodput
    assert "uses labkit's reference" in capsys.readouterr().out


def test_ch09_a_crashing_solution_is_reported() -> None:
    result = check_goodput(lambda records, slos, duration: records[99].ttft)
    assert result.status == "failed" and "IndexError" in result.failures[0]
