"""Interrupts (the notebook's ■ button, Ctrl-C): a ``KeyboardInterrupt`` mid-step drops the call's requests and
leaves the engine usable; real SIGINTs at random moments leave it consistent; one Ctrl-C during a step waits
for the step's end while a second takes effect at once; an ignored Ctrl-C stays ignored; and a real Jupyter
kernel interrupted during a long ``generate`` runs the next cell normally.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

import pytest
from conftest import assert_memory_returned

from labkit.core.sequence import Sequence

from .reliability_common import ALL, PAGED, PROMPTS, Fault, Reference, greedy, make, tokens


@pytest.mark.parametrize("engine", ALL)
def test_keyboard_interrupt_mid_step_leaves_the_engine_usable(tiny: Path, reference: Reference, engine: str) -> None:
    llm = make(tiny, engine, **({"block_size": 2} if engine in PAGED else {}))
    params = [greedy(6 + i) for i in range(len(PROMPTS))]
    want = reference(PROMPTS, params)
    fault = Fault(at=4, error=KeyboardInterrupt())
    llm.engine.fault_hook = fault
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert fault.hit and all(s.finish_reason.value == "abort" for s in fault.hit)
    assert not llm.engine.has_unfinished_requests()  # the whole call's requests were dropped
    assert_memory_returned([llm])
    llm.engine.fault_hook = None  # "the next cell"
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want
    fault = Fault(at=2, error=KeyboardInterrupt())
    llm.engine.fault_hook = fault
    with pytest.raises(KeyboardInterrupt):
        for _ in llm.stream(PROMPTS[1], greedy(8)):
            pass
    assert not llm.engine.has_unfinished_requests()
    llm.engine.fault_hook = None
    assert tokens(llm.generate(PROMPTS[1], greedy(8), use_tqdm=False)) == reference([PROMPTS[1]], [greedy(8)])


@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="needs POSIX signals")
@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("engine", ["kvcache", "chunked"])
def test_real_ctrl_c_at_random_moments(tiny: Path, reference: Reference, engine: str) -> None:
    """SIGINT from another thread at random moments of a run: the engine is consistent after every one."""
    llm = make(tiny, engine, **({"block_size": 2, "num_gpu_blocks": 40} if engine == "chunked" else {}))
    params = [greedy(60) for _ in PROMPTS]
    want = reference(PROMPTS, params)
    rng = random.Random(7)
    main = threading.get_ident()
    def interrupt(started: threading.Event, delay: float) -> None:
        started.wait(30)
        time.sleep(delay)
        signal.pthread_kill(main, signal.SIGINT)

    for _ in range(4):
        started = threading.Event()
        llm.engine.fault_hook = lambda seqs, started=started: started.set()  # type: ignore[misc]
        thread = threading.Thread(target=interrupt, args=(started, rng.uniform(0.0, 0.05)))
        thread.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                llm.generate(PROMPTS, params, use_tqdm=False)
                time.sleep(5)  # in case the run ended first (it is far longer than the delay): the signal lands here
        finally:
            thread.join()
        assert not llm.engine.has_unfinished_requests()
        assert_memory_returned([llm])
    llm.engine.fault_hook = None
    assert tokens(llm.generate(PROMPTS, params, use_tqdm=False)) == want


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signals")
@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_a_step_waits_for_its_end_unless_pressed_twice(tiny: Path, presses: int) -> None:
    """One Ctrl-C mid-step takes effect once the step is done (its tokens are kept); a second one, at once."""
    llm = make(tiny, "chunked", block_size=2)
    seen: dict[str, int] = {}

    def press(seqs: list[Sequence]) -> None:
        if llm.engine.num_steps == 3:
            seen["stats"] = len(llm.engine.step_stats)
            for _ in range(presses):
                signal.raise_signal(signal.SIGINT)

    llm.engine.fault_hook = press
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, greedy(10), use_tqdm=False)
    assert len(llm.engine.step_stats) == seen["stats"] + (1 if presses == 1 else 0)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is restored
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.skipif(not hasattr(signal, "raise_signal"), reason="needs signals")
def test_an_ignored_ctrl_c_stays_ignored(tiny: Path) -> None:
    """Where Ctrl-C is ignored (a background job) or handled by someone else, a step neither defers nor raises
    it, and the handler it found is the one it leaves."""
    llm = make(tiny, "chunked", block_size=2)
    llm.engine.fault_hook = lambda seqs: signal.raise_signal(signal.SIGINT)  # type: ignore[misc]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        outputs = llm.generate(PROMPTS, greedy(6), use_tqdm=False)  # every step "pressed": nothing happens
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_interrupting_a_notebook_cell_leaves_the_engine_usable_for_the_next(tiny: Path) -> None:
    """The real thing: a Jupyter kernel runs a long generate, the ■ button interrupts it, the next cell works."""
    manager = pytest.importorskip("jupyter_client.manager")
    km, kc = manager.start_new_kernel(kernel_name="python3")

    def reply_to(msg_id: str, timeout: float = 300) -> dict:  # type: ignore[type-arg]
        while True:  # skip replies to earlier requests (e.g. the kernel_info of start-up)
            reply = kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"]

    def run(code: str) -> dict:  # type: ignore[type-arg]
        return reply_to(kc.execute(code))

    try:
        setup = run(f"from labkit import LLM, SamplingParams\n"
                    f"llm = LLM({str(tiny)!r}, engine='chunked', dtype='float64', max_num_seqs=2, block_size=4)\n"
                    f"p = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)\n"
                    f"want = llm.generate(['Once upon a time'], p, use_tqdm=False)[0].outputs[0].token_ids")
        assert setup["status"] == "ok", setup
        # Generate until interrupted, so the ■ can never arrive after the work is done (one generate takes
        # ~0.4 s on a quiet machine); stop_on_error=False: the kernel must not discard the next cell.
        msg_id = kc.execute("while True:\n    llm.generate(['Once upon a time'] * 12, p, use_tqdm=False)",
                            stop_on_error=False)
        while True:  # wait until the cell runs, then let it get well into the generation
            msg = kc.get_iopub_msg(timeout=60)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
                break
        time.sleep(1.0)
        km.interrupt_kernel()
        reply = reply_to(msg_id, timeout=120)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        after = run("bm = llm.engine.block_manager\n"
                    "assert not llm.engine.has_unfinished_requests()\n"
                    "assert bm.num_free_blocks == bm.num_blocks, bm.num_used_blocks\n"
                    "bm.check_invariants([])\n"
                    "assert llm.generate(['Once upon a time'], p, use_tqdm=False)[0].outputs[0].token_ids == want")
        assert after["status"] == "ok", after
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
