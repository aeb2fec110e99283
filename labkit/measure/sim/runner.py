"""A simulated model runner and one simulated engine instance, in virtual time, around labkit's own scheduler.

``SimInstance`` holds a real ``BlockManager`` and a real ``Scheduler`` (the very classes the engines run, not a
copy): each step the scheduler plans a ``SchedulerOutput`` exactly as it would on a device, and
``SimulatedModelRunner`` stands in for the model: the step takes ``StepCostModel.step_time`` seconds of
virtual time, every sequence advances by its scheduled tokens, and those that caught up emit a token (id 0: no
text is needed to time a workload). Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

from labkit.core.kv.block_manager import BlockManager
from labkit.core.metrics import RequestMetrics
from labkit.core.sampling_params import SamplingParams
from labkit.core.sched.output import SchedulerOutput
from labkit.core.sched.scheduler import Scheduler
from labkit.core.sched.stop import finish
from labkit.core.sequence import FinishReason, Sequence, SequenceStatus
from labkit.measure.sim.cost_model import StepCostModel, StepShape


class SilentDetokenizer:
    """A simulated request has no text: nothing to detokenize, no stop string. Notebook 12."""

    stop_reason = None
    text = ""

    def append(self, token_id: int) -> None:
        pass


def sim_sequence(seq_id: int, prompt_len: int, output_len: int, arrival: float, max_model_len: int) -> Sequence:
    """A ``Sequence`` the scheduler and block manager handle as any other (prompt ids are placeholders)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return Sequence(seq_id=seq_id, prompt=None, prompt_token_ids=[0] * prompt_len, params=params,
                    detokenizer=SilentDetokenizer(),  # type: ignore[arg-type]  # has what Sequence uses
                    generator=None, metrics=RequestMetrics(arrival_time=arrival), max_model_len=max_model_len)


class SimulatedModelRunner:
    """Prices a step with the cost model and advances its sequences; no model runs. Notebook 12."""

    def __init__(self, cost: StepCostModel) -> None:
        self.cost = cost

    def run(self, out: SchedulerOutput) -> tuple[float, list[Sequence]]:
        """(the step's seconds, the sequences that emit a token at its end)."""
        seconds = self.cost.step_time(StepShape.of(out))
        sampled = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:  # caught up: this step yields the next token
                sampled.append(seq)
        return seconds, sampled


class SimInstance:
    """One simulated engine (or worker): block manager, labkit's ``Scheduler``, simulated runner. Notebook 12."""

    def __init__(self, cost: StepCostModel, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True,
                 scheduler_cls: type[Scheduler] = Scheduler) -> None:
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = scheduler_cls(self.block_manager, max_num_seqs, max_num_batched_tokens,
                                       enable_chunked_prefill)
        self.runner = SimulatedModelRunner(cost)
        self.busy_until = 0.0
        self.busy_time = 0.0  # virtual seconds spent in steps
        self.num_steps = 0

    def step(self, now: float) -> tuple[float, list[Sequence]] | None:
        """Plan and run one step starting at ``now``: (its end, the sequences given a token then), or None if
        there was nothing to run. Tokens are stamped, and finished sequences leave, at the step's end."""
        out = self.scheduler.schedule(now)
        if not out.seqs:
            return None
        seconds, sampled = self.runner.run(out)
        end = now + seconds
        for seq in sampled:
            seq.record_token(0, end)
            if seq.num_output_tokens >= (seq.params.max_tokens or 0) or seq.num_tokens >= seq.max_model_len:
                finish(seq, FinishReason.LENGTH, None, end)
                self.scheduler.finish_request(seq)
        self.busy_until, self.busy_time, self.num_steps = end, self.busy_time + seconds, self.num_steps + 1
        return end, sampled

    def receive(self, seq: Sequence) -> bool:
        """A request prefilled elsewhere joins this (decode) instance, if blocks and a slot are free: what
        ``KVReceiver.receive_kv`` does, without bytes to write."""
        bm, sched = self.block_manager, self.scheduler
        if len(sched.running) >= sched.max_num_seqs or not bm.can_allocate(seq, seq.num_prompt_tokens):
            return False
        bm.allocate(seq, seq.num_prompt_tokens)
        seq.num_computed_tokens = seq.num_prompt_tokens
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        return True

    @property
    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)
