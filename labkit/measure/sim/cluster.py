"""A cluster in virtual time: colocated engines, or prefill and decode workers joined by a link.

Each worker is a ``SimInstance`` (labkit's ``Scheduler`` and ``BlockManager``, a simulated runner priced by the
fitted cost model). ``simulate`` replays a workload through an event queue: arrivals go to the least loaded
instance that prefills; in a disaggregated cluster a request whose prompt is done on a prefill worker leaves it,
its KV travels for ``latency + bytes / bandwidth`` seconds, and the least loaded decode worker takes it off the link
between two of its steps (its first token is stamped then, as labkit's engine samples it there) and admits it as
soon as it has the blocks (``SimInstance.receive``). Every request's token times come out as
``RequestRecord``s, so the metrics are notebook 09's (TTFT, TPOT, ITL, goodput under SLOs); DistServe's figure
of merit, the highest rate per device at which an attainment target holds, is ``labkit.measure.sim.goodput``'s.
Prefill workers run whole prompts (``ClusterSpec.prefill_max_num_batched_tokens``). Transfers do not queue behind
each other on the link (a simplification).
Introduced in notebook 12 (``12_disaggregated_prefill``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass, field

from labkit.core.sequence import Sequence
from labkit.measure.loadgen.metrics import BenchMetrics, RequestRecord, calculate_metrics, count_good_requests
from labkit.measure.sim.cost_model import StepCostModel
from labkit.measure.sim.runner import SimInstance, sim_sequence
from labkit.measure.sim.tensor_parallel import TensorParallelCost, TensorParallelSpec


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated workload: when it arrives (s), its prompt and output lengths. Notebook 12."""

    arrival: float
    prompt_len: int
    output_len: int


@dataclass
class ClusterSpec:
    """The cluster: ``num_prefill`` 0 means ``num_decode`` colocated (chunked) engines. Notebook 12."""

    num_prefill: int = 0
    num_decode: int = 1
    kv_bytes_per_token: int = 0  # all layers, K and V (``labkit.measure.roofline.kv_bytes_per_token``)
    link_bandwidth: float = math.inf  # bytes/s between a prefill and a decode worker
    link_latency: float = 0.0  # s per transfer
    num_blocks: int = 4096  # per worker
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # A dedicated prefill worker runs each prompt whole (DistServe, vLLM's prefill instances): its token budget is
    # the longest prompt of the workload (None), not the colocated engines' chunk budget, which would charge a long
    # prompt one fixed step cost per chunk and bias the comparison against disaggregation.
    prefill_max_num_batched_tokens: int | None = None
    # Tensor parallelism per phase (notebook 15): each worker is that many devices; colocated engines use decode_tp.
    prefill_tp: int = 1
    decode_tp: int = 1
    tp: TensorParallelSpec = field(default_factory=TensorParallelSpec)  # what the all-reduces cost

    @property
    def num_devices(self) -> int:
        return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp

    def transfer_time(self, prompt_len: int) -> float:
        blocks = -(-prompt_len // self.block_size)
        return self.link_latency + blocks * self.block_size * self.kv_bytes_per_token / self.link_bandwidth

    def label(self) -> str:
        if not self.num_prefill:
            return f"{self.num_decode} colocated" + (f" (TP{self.decode_tp})" if self.decode_tp > 1 else "")
        if self.prefill_tp == self.decode_tp == 1:
            return f"{self.num_prefill}P:{self.num_decode}D"
        return f"{self.num_prefill}P(TP{self.prefill_tp}):{self.num_decode}D(TP{self.decode_tp})"


@dataclass
class SimResult:
    """A simulated run: per-request records, the metrics under the SLOs, the workers' busy time. Notebook 12."""

    spec: ClusterSpec
    records: list[RequestRecord]
    metrics: BenchMetrics
    busy_fraction: list[float] = field(default_factory=list)
    kv_bytes_moved: int = 0

    def goodput_per_device(self, slos_ms: dict[str, float]) -> float:
        return count_good_requests(self.records, slos_ms) / self.metrics.duration / self.spec.num_devices


def make_instance(cost: StepCostModel, spec: ClusterSpec) -> SimInstance:
    return SimInstance(cost, spec.num_blocks, spec.block_size, spec.max_num_seqs, spec.max_num_batched_tokens)


def at_degree(cost: StepCostModel, spec: ClusterSpec, tp: int) -> StepCostModel:
    """The cost model of a worker of TP degree ``tp`` (notebook 15): compute / tp plus its all-reduces."""
    return TensorParallelCost(cost, tp, spec.tp) if tp > 1 else cost  # type: ignore[return-value]


def simulate(requests: list[SimRequest], cost: StepCostModel, spec: ClusterSpec,
             slos_ms: dict[str, float] | None = None, max_model_len: int = 1 << 20) -> SimResult:
    """Run ``requests`` through the cluster in virtual time; every request completes."""
    disagg = spec.num_prefill > 0
    whole = spec.prefill_max_num_batched_tokens or max(spec.max_num_batched_tokens,
                                                       max((r.prompt_len for r in requests), default=0))
    prefill_cost, decode_cost = at_degree(cost, spec, spec.prefill_tp), at_degree(cost, spec, spec.decode_tp)
    whole_prompts = dataclasses.replace(spec, max_num_batched_tokens=whole)  # a prefill worker's budget
    prefill = ([make_instance(prefill_cost, whole_prompts) for _ in range(spec.num_prefill)] if disagg else
               [make_instance(decode_cost, spec) for _ in range(spec.num_decode)])
    decode = [make_instance(decode_cost, spec) for _ in range(spec.num_decode)] if disagg else prefill
    inbox: list[list[Sequence]] = [[] for _ in decode]  # received KV waiting for blocks, per decode worker
    seqs = [sim_sequence(i, r.prompt_len, r.output_len, r.arrival, max_model_len) for i, r in enumerate(requests)]
    events: list[tuple[float, int, str, int]] = []  # (time, tie-break, kind, index)
    order = 0

    def push(t: float, kind: str, index: int) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, index))
        order += 1

    for i, r in enumerate(requests):
        push(r.arrival, "arrive", i)
    stepping: set[int] = set()  # id() of instances inside a step
    picked_up: set[int] = set()  # seq_ids whose KV a decode worker has taken off the link
    kv_bytes = 0
    now = 0.0

    def kick(t: float) -> None:
        nonlocal kv_bytes
        for d, inst in enumerate(decode):
            if id(inst) in stepping:
                continue  # a decode worker reads the link between its steps
            for seq in inbox[d]:
                if seq.seq_id not in picked_up:  # labkit samples the first token here, from the logits sent along
                    picked_up.add(seq.seq_id)
                    seq.metrics.token_times[0] = t
            while inbox[d] and inst.receive(inbox[d][0]):
                inbox[d].pop(0)
        for inst in dict.fromkeys(prefill + decode):  # each once (colocated: the same list)
            if id(inst) in stepping:
                continue
            ran = inst.step(t)
            if ran is None:
                continue
            end, sampled = ran
            stepping.add(id(inst))
            push(end, "step_end", id(inst))
            if disagg and inst in prefill:
                for seq in sampled:  # the first token: hand the request over to a decode worker
                    if seq.is_finished:
                        continue
                    inst.scheduler.finish_request(seq)  # its prefill blocks go back (the KV is on its way)
                    target = min(range(len(decode)), key=lambda j: decode[j].load + len(inbox[j]))
                    kv_bytes += -(-seq.num_prompt_tokens // spec.block_size) * spec.block_size * \
                        spec.kv_bytes_per_token
                    push(end + spec.transfer_time(seq.num_prompt_tokens), f"kv:{target}", seq.seq_id)

    while events:
        now, _, kind, index = heapq.heappop(events)
        if kind == "arrive":
            min(prefill, key=lambda inst: inst.load).scheduler.add_request(seqs[index])
        elif kind == "step_end":
            stepping.discard(index)
        else:
            inbox[int(kind.split(":")[1])].append(seqs[index])
        if events and events[0][0] == now:
            continue  # take every event of this instant before planning steps
        kick(now)
    unfinished = [s.seq_id for s in seqs if not s.is_finished]
    assert not unfinished, f"simulation ended with requests {unfinished[:5]} unfinished"
    records = [record_of(s, r) for s, r in zip(seqs, requests)]
    start = min(r.arrival for r in requests)
    duration = max(max(s.metrics.token_times) for s in seqs) - start
    workers = list(dict.fromkeys(prefill + decode))
    busy = [w.busy_time / duration for w in workers]
    return SimResult(spec, records, calculate_metrics(records, duration, slos_ms), busy, kv_bytes)


def record_of(seq: Sequence, req: SimRequest) -> RequestRecord:
    times = seq.metrics.token_times
    return RequestRecord(success=True, prompt_len=req.prompt_len, output_tokens=len(times),
                         ttft=times[0] - req.arrival, itl=[b - a for a, b in zip(times, times[1:])],
                         latency=times[-1] - req.arrival, start_time=req.arrival)
