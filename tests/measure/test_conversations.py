"""Multi-turn chat and agent workloads: seeded, reproducible, committed files match, prompts carry the history."""

from __future__ import annotations

import pytest

from labkit.measure.conversations import (
    CONVERSATIONS,
    CONVERSATIONS_DIR,
    ConversationState,
    ConversationWorkload,
    Turn,
    agent_calls,
    conversation_trace,
    load_conversations,
    main,
    multi_turn_chat,
)


def test_generators_are_seeded() -> None:
    chat = dict(num_sessions=5, num_turns=3, user_range=(4, 40), output_range=(4, 20), system_prompt_len=16)
    assert multi_turn_chat(**chat, seed=1) == multi_turn_chat(**chat, seed=1)
    assert multi_turn_chat(**chat, seed=1) != multi_turn_chat(**chat, seed=2)
    agent = dict(num_agents=3, num_calls=4, context_len=64, observation_range=(4, 16), output_range=(2, 8))
    assert agent_calls(**agent, seed=1) == agent_calls(**agent, seed=1)
    assert agent_calls(**agent, seed=1) != agent_calls(**agent, seed=2)


def test_turns_arrive_in_order_and_lengths_add_up() -> None:
    wl = multi_turn_chat(6, 4, (4, 40), (4, 20), seed=3, system_prompt_len=10)
    assert [t.arrival_time for t in wl.turns] == sorted(t.arrival_time for t in wl.turns)
    assert wl.num_sessions == 6 and len(wl) == 24
    assert len({t.session for t in wl.turns[:6]}) > 1, "sessions should interleave"
    history: dict[int, int] = {}
    for turn, prompt_len in zip(wl.turns, wl.prompt_lens(), strict=True):
        assert prompt_len == 10 + history.get(turn.session, 0) + turn.user_len
        history[turn.session] = history.get(turn.session, 0) + turn.user_len + turn.output_len
    agent = agent_calls(3, 5, 100, (4, 16), (2, 8), seed=0)
    assert min(agent.prompt_lens()) > 100 and agent.kind == "agent"
    two = wl.first_sessions(2)
    assert two.num_sessions == 2 and two.turns == [t for t in wl.turns if t.session < 2]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="user_len"):
        Turn(0, 0, 0, 5, 0.0)
    with pytest.raises(ValueError, match="out of order"):
        ConversationWorkload("x", "chat", 0, [Turn(0, 1, 5, 5, 0.0)], seed=0)
    with pytest.raises(ValueError, match="kind"):
        ConversationWorkload("x", "email", 0, [], seed=0)
    with pytest.raises(ValueError, match="num_sessions"):
        multi_turn_chat(0, 3, (1, 2), (1, 2), seed=0)
    with pytest.raises(FileNotFoundError, match="chat_8x4"):
        load_conversations("nope")


def test_jsonl_round_trip_and_committed_files_match(tmp_path) -> None:  # type: ignore[no-untyped-def]
    wl = agent_calls(2, 3, 50, (4, 8), (2, 4), seed=5)
    assert ConversationWorkload.from_jsonl(wl.to_jsonl(tmp_path / "a.jsonl")) == wl
    assert sorted(p.stem for p in CONVERSATIONS_DIR.glob("*.jsonl")) == sorted(CONVERSATIONS)
    for name, build in CONVERSATIONS.items():
        assert load_conversations(name) == build(), f"{name}: run python -m labkit.measure.conversations"
    assert main(["--check"]) == 0


def test_each_prompt_is_the_history_plus_the_new_message(tokenizer) -> None:  # type: ignore[no-untyped-def]
    wl = load_conversations("chat_8x4")
    calls = conversation_trace(wl, tokenizer, seed=0)
    assert calls == conversation_trace(wl, tokenizer, seed=0), "not reproducible"
    assert calls != conversation_trace(wl, tokenizer, seed=1)
    assert [len(p) for p, _ in calls] == wl.prompt_lens()
    assert [len(a) for _, a in calls] == [t.output_len for t in wl.turns]
    last: dict[int, list[int]] = {}
    shared = calls[0][0][: wl.shared_prefix_len]
    assert shared[0] == tokenizer.bos_token_id
    for turn, (prompt, answer) in zip(wl.turns, calls, strict=True):
        assert prompt[: wl.shared_prefix_len] == shared
        if turn.session in last:  # turn k's prompt starts with turn k-1's prompt and answer
            assert prompt[: len(last[turn.session])] == last[turn.session]
        last[turn.session] = prompt + answer
    firsts = [p for t, (p, _) in zip(wl.turns, calls, strict=True) if t.turn == 0]
    assert len({tuple(p[wl.shared_prefix_len : wl.shared_prefix_len + 8]) for p in firsts}) == len(firsts)


def test_live_answers_join_the_history(tokenizer) -> None:  # type: ignore[no-untyped-def]
    wl = multi_turn_chat(1, 2, (5, 5), (3, 3), seed=0)  # no shared prefix: the first message carries BOS
    state = ConversationState(wl, tokenizer)
    first, second = wl.turns
    with pytest.raises(ValueError, match="before the answers"):
        state.prompt_ids(second)
    p0 = state.prompt_ids(first)
    assert p0[0] == tokenizer.bos_token_id and len(p0) == 5
    state.add_answer(first, [7, 8, 9])
    p1 = state.prompt_ids(second)
    assert p1[:8] == p0 + [7, 8, 9] and len(p1) == 13 and tokenizer.bos_token_id not in p1[1:]
