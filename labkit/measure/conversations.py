"""Seeded multi-turn workloads: chat sessions and agents whose every call resends the whole conversation so far.

A chat client sends, at turn k, the system prompt, every earlier user message and answer, and the new message;
an agent sends a long shared context (instructions, tool descriptions, a document) and then, call after call, its
history of tool results and actions. So most of each prompt is a prefix the server has seen before: prefix
caching can skip it, as long as its KV blocks were not evicted in between. Introduced in notebook 06
(``06_paged_attention``, KV reuse across turns).

    wl = load_conversations("chat_8x4")                      # lengths only, from data/workloads/conversations/
    state = ConversationState(wl, tokenizer, seed=0)
    for turn in wl.turns:                                     # arrival order, sessions interleaved
        ids = state.prompt_ids(turn)                          # shared prefix + history + this turn's message
        out = llm.generate([ids], SamplingParams(max_tokens=turn.output_len, ignore_eos=True))[0]
        state.add_answer(turn, out.outputs[0].token_ids)      # the answer joins the history

Lengths are in tokens; the generators are pure (same arguments, same workload); the files are written by
``python -m labkit.measure.conversations`` and checked against the generators by the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from labkit.measure.workloads import HEADER_KEY, WORKLOADS_DIR, prompt_ids_of_length

CONVERSATIONS_DIR = WORKLOADS_DIR / "conversations"
KINDS = ("chat", "agent")


@dataclass(frozen=True)
class Turn:
    """One call of a session: the tokens it adds to the history, the answer's length, its arrival. Notebook 06.

    ``user_len``: the new message (chat) or tool result (agent) at the end of this call's prompt.
    """

    session: int
    turn: int
    user_len: int
    output_len: int
    arrival_time: float

    def __post_init__(self) -> None:
        for name in ("user_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.session < 0 or self.turn < 0 or self.arrival_time < 0:
            raise ValueError(f"session, turn and arrival_time must be >= 0, got {self}")


@dataclass
class ConversationWorkload:
    """Sessions of turns, in arrival order, behind one shared prefix. Notebook 06."""

    name: str
    kind: str  # "chat" or "agent"
    shared_prefix_len: int  # tokens every prompt starts with: a system prompt, an agent's context
    turns: list[Turn]
    seed: int
    description: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        seen: dict[int, int] = {}
        for t in self.turns:  # each session's turns come in order 0, 1, 2, ...
            if t.turn != seen.get(t.session, 0):
                raise ValueError(f"session {t.session}: turn {t.turn} arrives out of order")
            seen[t.session] = t.turn + 1

    def __len__(self) -> int:
        return len(self.turns)

    @property
    def num_sessions(self) -> int:
        return len({t.session for t in self.turns})

    def first_sessions(self, num_sessions: int) -> ConversationWorkload:
        """The same workload keeping only sessions 0 .. num_sessions-1 (smoke mode's smaller run)."""
        turns = [t for t in self.turns if t.session < num_sessions]
        return dataclasses.replace(self, name=f"{self.name}[:{num_sessions}]", turns=turns)

    def prompt_lens(self) -> list[int]:
        """Each call's prompt length, in arrival order, when every answer is exactly ``output_len`` tokens."""
        history: dict[int, int] = {}
        lens = []
        for t in self.turns:
            lens.append(self.shared_prefix_len + history.get(t.session, 0) + t.user_len)
            history[t.session] = history.get(t.session, 0) + t.user_len + t.output_len
        return lens

    @property
    def max_seq_len(self) -> int:
        """The longest prompt + answer: the engine's max_model_len must be at least this."""
        return max((p + t.output_len for p, t in zip(self.prompt_lens(), self.turns, strict=True)), default=0)

    def summary(self) -> str:
        lens = self.prompt_lens()
        return (f"{self.name}: {self.kind}, {self.num_sessions} sessions, {len(self)} calls, shared prefix "
                f"{self.shared_prefix_len} tokens, prompts {min(lens)}-{max(lens)} tokens "
                f"({sum(lens)} in all), answers {sum(t.output_len for t in self.turns)} tokens")

    def to_jsonl(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {HEADER_KEY: self.name, "kind": self.kind, "shared_prefix_len": self.shared_prefix_len,
                  "seed": self.seed, "description": self.description, "num_turns": len(self)}
        lines = [json.dumps(header)] + [json.dumps(dataclasses.asdict(t)) for t in self.turns]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_jsonl(cls, path: str | Path) -> ConversationWorkload:
        path = Path(path)
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not rows or HEADER_KEY not in rows[0]:
            raise ValueError(f"{path}: the first line must be a header naming the workload")
        header = rows.pop(0)
        turns = [Turn(**row) for row in rows]
        if header.get("num_turns") != len(turns):
            raise ValueError(f"{path}: header says {header.get('num_turns')} turns, file has {len(turns)}")
        return cls(name=header[HEADER_KEY], kind=header["kind"], shared_prefix_len=header["shared_prefix_len"],
                   turns=turns, seed=header["seed"], description=header.get("description", ""))


def _in_arrival_order(turns: list[Turn]) -> list[Turn]:
    return sorted(turns, key=lambda t: (t.arrival_time, t.session, t.turn))


def multi_turn_chat(num_sessions: int, num_turns: int, user_range: tuple[int, int],
                    output_range: tuple[int, int], seed: int, system_prompt_len: int = 0,
                    session_gap_s: float = 1.0, think_time_s: float = 4.0, name: str | None = None
                    ) -> ConversationWorkload:
    """Chat: sessions start about ``session_gap_s`` apart (Poisson); each user thinks about ``think_time_s``
    (exponential) between turns, so turns of different sessions interleave. Notebook 06."""
    if num_sessions < 1 or num_turns < 1:
        raise ValueError(f"need num_sessions >= 1 and num_turns >= 1, got {num_sessions} and {num_turns}")
    rng = random.Random(seed)
    turns, start = [], 0.0
    for s in range(num_sessions):
        start += rng.expovariate(1 / session_gap_s)
        t = start
        for k in range(num_turns):
            turns.append(Turn(s, k, rng.randint(*user_range), rng.randint(*output_range), round(t, 3)))
            t += rng.expovariate(1 / think_time_s)
    return ConversationWorkload(
        name or f"chat_{num_sessions}x{num_turns}", "chat", system_prompt_len, _in_arrival_order(turns), seed,
        f"multi_turn_chat(num_sessions={num_sessions}, num_turns={num_turns}, user_range={tuple(user_range)}, "
        f"output_range={tuple(output_range)}, seed={seed}, system_prompt_len={system_prompt_len}, "
        f"session_gap_s={session_gap_s}, think_time_s={think_time_s})")


def agent_calls(num_agents: int, num_calls: int, context_len: int, observation_range: tuple[int, int],
                output_range: tuple[int, int], seed: int, tool_time_s: float = 0.5, name: str | None = None
                ) -> ConversationWorkload:
    """Agents: one long shared context, then many short calls each: a tool result in, a short action out.
    The agents run side by side (they start together; tools take about ``tool_time_s``). Notebook 06."""
    if num_agents < 1 or num_calls < 1 or context_len < 1:
        raise ValueError(f"need num_agents, num_calls, context_len >= 1, got {num_agents}, {num_calls}, "
                         f"{context_len}")
    rng = random.Random(seed)
    turns = []
    for a in range(num_agents):
        t = rng.uniform(0, tool_time_s)
        for k in range(num_calls):
            turns.append(Turn(a, k, rng.randint(*observation_range), rng.randint(*output_range), round(t, 3)))
            t += rng.expovariate(1 / tool_time_s)
    return ConversationWorkload(
        name or f"agent_{num_agents}x{num_calls}", "agent", context_len, _in_arrival_order(turns), seed,
        f"agent_calls(num_agents={num_agents}, num_calls={num_calls}, context_len={context_len}, "
        f"observation_range={tuple(observation_range)}, output_range={tuple(output_range)}, seed={seed}, "
        f"tool_time_s={tool_time_s})")


# name -> how to build it; the file is data/workloads/conversations/<name>.jsonl
CONVERSATIONS: dict[str, Callable[[], ConversationWorkload]] = {
    "chat_8x4": lambda: multi_turn_chat(8, 4, (8, 32), (8, 24), seed=11, system_prompt_len=32, name="chat_8x4"),
    "chat_32x6": lambda: multi_turn_chat(32, 6, (16, 64), (16, 64), seed=12, system_prompt_len=64,
                                         name="chat_32x6"),
    "agent_4x6": lambda: agent_calls(4, 6, 128, (8, 24), (4, 12), seed=13, name="agent_4x6"),
    "agent_16x12": lambda: agent_calls(16, 12, 512, (16, 48), (8, 24), seed=14, name="agent_16x12"),
}


def load_conversations(name: str) -> ConversationWorkload:
    """A workload shipped in data/workloads/conversations/, by name."""
    path = CONVERSATIONS_DIR / f"{name}.jsonl"
    if not path.is_file():
        known = sorted(p.stem for p in CONVERSATIONS_DIR.glob("*.jsonl"))
        raise FileNotFoundError(f"no conversation workload {name!r} in {CONVERSATIONS_DIR}; available: "
                                f"{', '.join(known) or 'none'}")
    return ConversationWorkload.from_jsonl(path)


# ---- token ids: the prompt of each call ----

@dataclass
class ConversationState:
    """Each session's history, so every call's prompt is the shared prefix + history + its new message.

    The message texts are seeded in-domain text (different per session and turn); the answers are whatever
    ``add_answer`` is given: the engine's own output (live), or ``stand_in_answer`` for a trace without a model.
    Notebook 06.
    """

    workload: ConversationWorkload
    tokenizer: PreTrainedTokenizerBase
    seed: int = 0
    history: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.shared_prefix = self._text(self.workload.shared_prefix_len, -1, -1, bos=True)

    def _text(self, num_tokens: int, session: int, turn: int, bos: bool) -> list[int]:
        if num_tokens == 0:
            return []
        rng = random.Random(f"{self.seed}/{session}/{turn}")  # str seeds hash the same in every process
        offset = rng.randrange(64)  # stories open alike: a random offset keeps texts from sharing a prefix
        ids = prompt_ids_of_length(self.tokenizer, num_tokens + offset + 1, rng.randrange(2**31))[1 + offset:]
        head = [self.tokenizer.bos_token_id] if bos and self.tokenizer.bos_token_id is not None else []
        return head + ids[: num_tokens - len(head)]

    def message_ids(self, turn: Turn) -> list[int]:
        """The new tokens this call adds (BOS first when nothing precedes them)."""
        first = self.workload.shared_prefix_len == 0 and turn.turn == 0
        return self._text(turn.user_len, turn.session, turn.turn, bos=first)

    def prompt_ids(self, turn: Turn) -> list[int]:
        history = self.history.get(turn.session, [])
        if turn.turn > 0 and not history:
            raise ValueError(f"session {turn.session}: turn {turn.turn} before the answers to the earlier turns")
        return self.shared_prefix + history + self.message_ids(turn)

    def add_answer(self, turn: Turn, output_ids: list[int]) -> None:
        self.history[turn.session] = self.history.get(turn.session, []) + self.message_ids(turn) + list(output_ids)

    def stand_in_answer(self, turn: Turn) -> list[int]:
        """``output_len`` ids of seeded text, in place of a model's answer (for traces without a model)."""
        return self._text(turn.output_len, turn.session, -2 - turn.turn, bos=False)


def conversation_trace(workload: ConversationWorkload, tokenizer: PreTrainedTokenizerBase, seed: int = 0
                       ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of every call in arrival order, with stand-in answers: no model needed."""
    state = ConversationState(workload, tokenizer, seed)
    calls = []
    for turn in workload.turns:
        prompt, answer = state.prompt_ids(turn), state.stand_in_answer(turn)
        state.add_answer(turn, answer)
        calls.append((prompt, answer))
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write (or --check) data/workloads/conversations/*.jsonl")
    parser.add_argument("--check", action="store_true", help="compare with the files on disk; write nothing")
    args = parser.parse_args(argv)
    stale: list[Any] = []
    for name, build in CONVERSATIONS.items():
        wl, path = build(), CONVERSATIONS_DIR / f"{name}.jsonl"
        if args.check:
            if not path.is_file() or ConversationWorkload.from_jsonl(path) != wl:
                stale.append(name)
        else:
            print(f"wrote {wl.to_jsonl(path)}: {wl.summary()}")
    if stale:
        print(f"out of date: {', '.join(stale)}; run python -m labkit.measure.conversations", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
