"""benchmarks/chat_load.py's pure parts: chat sessions whose turns grow one shared prefix, and the mixed
schedule (the chat share, sessions kept in order, the same requests for every configuration); and, on a
real plain vLLM server (marker vllm), that the open loop sends a turn only once its session's previous turn
ended while RAG requests go at their arrival."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from chat_load import CHAT_SYSTEM_TOKENS, Arrival, ChatWorkload, MixedLoad, mixed_open_loop, mixed_schedule
from rag_load import RagWorkload, Target

USER_LENGTHS = (20, 40)
REPLY_TOKENS = 8


@pytest.fixture(scope="module")
def chat() -> ChatWorkload:
    return ChatWorkload(USER_LENGTHS, REPLY_TOKENS, turns_per_session=5, seed=0)


@pytest.fixture(scope="module")
def rag() -> RagWorkload:
    return RagWorkload((60, 120), num_docs=12, docs_per_prompt=3, seed=0)


def test_each_turn_extends_the_last_one_by_a_reply_and_a_user_message(chat):
    turns = chat.session(random.Random(1), session=7)
    assert [t.turn for t in turns] == [0, 1, 2, 3, 4] and {t.session for t in turns} == {7}
    assert turns[0].ids[:CHAT_SYSTEM_TOKENS] == chat.system
    assert USER_LENGTHS[0] <= len(turns[0].ids) - CHAT_SYSTEM_TOKENS <= USER_LENGTHS[1]
    for before, after in itertools.pairwise(turns):
        assert after.ids[:len(before.ids)] == before.ids  # the growing prefix vLLM's cache serves
        added = len(after.ids) - len(before.ids) - REPLY_TOKENS
        assert USER_LENGTHS[0] <= added <= USER_LENGTHS[1]
    assert len(turns[-1].ids) <= chat.max_prompt_tokens()


def test_sessions_share_the_system_prompt_and_nothing_else(chat):
    rng = random.Random(2)
    first, second = chat.session(rng, 0), chat.session(rng, 1)
    assert first[0].ids[:CHAT_SYSTEM_TOKENS] == second[0].ids[:CHAT_SYSTEM_TOKENS]
    assert first[0].ids[CHAT_SYSTEM_TOKENS:] != second[0].ids[CHAT_SYSTEM_TOKENS:]


def test_the_chat_system_prompt_is_not_the_rag_one(chat, rag):
    assert chat.system[:len(rag.system)] != rag.system  # a chat turn never hits a RAG prefix


def check_sessions_in_order(arrivals: list[Arrival]) -> dict[int, list[int]]:
    """Each session's turns: 0, 1, ... in arrival order, each waiting for the one before; returns them."""
    sessions: dict[int, list[int]] = {}
    for index, arrival in enumerate(arrivals):
        if arrival.kind != "chat":
            assert arrival.after is None
            continue
        previous = sessions.setdefault(arrival.prompt.session, [])
        assert arrival.prompt.turn == len(previous)
        assert arrival.after == (previous[-1] if previous else None)
        previous.append(index)
    return sessions


@pytest.mark.parametrize("chat_share", [0.2, 0.5, 0.8])
def test_the_schedule_mixes_chat_turns_and_rag_prompts_at_the_chat_share(chat, rag, chat_share):
    arrivals = mixed_schedule(MixedLoad(rate=20.0, chat_share=chat_share, num_sessions=6), 200.0, chat, rag, "s")
    share = sum(a.kind == "chat" for a in arrivals) / len(arrivals)
    sigma = (chat_share * (1 - chat_share) / len(arrivals)) ** 0.5
    assert abs(share - chat_share) <= 4 * sigma
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    assert all(a.prompt.hit for a in arrivals if a.kind == "rag")  # hit rate 1.0 by default


def test_a_session_s_turns_come_in_order_and_wait_for_the_one_before(chat, rag):
    arrivals = mixed_schedule(MixedLoad(rate=10.0, chat_share=0.6, num_sessions=4), 120.0, chat, rag, "order")
    sessions = check_sessions_in_order(arrivals)
    assert len(sessions) > 4  # sessions ended after their 5 turns and fresh ones took their places
    assert all(len(turns) == 5 for turns in list(sessions.values())[:4])


def test_at_most_num_sessions_are_live_at_a_time(chat, rag):
    arrivals = mixed_schedule(MixedLoad(rate=10.0, chat_share=0.9, num_sessions=3), 60.0, chat, rag, "live")
    live: set[int] = set()
    for arrival in (a for a in arrivals if a.kind == "chat"):
        live.add(arrival.prompt.session)
        if arrival.prompt.turn == chat.turns_per_session - 1:
            live.discard(arrival.prompt.session)
        assert len(live) <= 3


def test_check_sessions_in_order_catches_a_turn_that_does_not_wait(chat, rag):
    # negative control for the order test: the same schedule with one turn's wait dropped is refused
    arrivals = mixed_schedule(MixedLoad(rate=10.0, chat_share=0.6, num_sessions=4), 30.0, chat, rag, "order")
    index = next(i for i, a in enumerate(arrivals) if a.kind == "chat" and a.after is not None)
    broken = [*arrivals[:index], Arrival(arrivals[index].at_s, "chat", arrivals[index].prompt), *arrivals[index + 1:]]
    with pytest.raises(AssertionError):
        check_sessions_in_order(broken)


def test_the_same_seed_gives_every_configuration_the_same_requests(chat, rag):
    load = MixedLoad(rate=5.0, chat_share=0.5, num_sessions=4, hit_rate=0.5)
    first, again = (mixed_schedule(load, 30.0, chat, rag, "seed") for _ in range(2))
    assert [(a.at_s, a.kind, a.prompt.ids, a.after) for a in first] == \
        [(a.at_s, a.kind, a.prompt.ids, a.after) for a in again]
    other = mixed_schedule(load, 30.0, chat, rag, "other")
    assert [a.prompt.ids for a in other] != [a.prompt.ids for a in first]


@pytest.mark.parametrize("load", [MixedLoad(1.0, chat_share=1.5, num_sessions=2), MixedLoad(1.0, 0.5, num_sessions=0)])
def test_a_bad_mix_is_refused(chat, rag, load):
    with pytest.raises(ValueError, match="chat_share"):
        mixed_schedule(load, 10.0, chat, rag, "bad")


def test_a_session_without_turns_is_refused():
    with pytest.raises(ValueError, match="turns_per_session"):
        ChatWorkload(USER_LENGTHS, REPLY_TOKENS, turns_per_session=0)


@pytest.fixture(scope="module")
def plain_server(tiny_model_dir, tmp_path_factory):
    """A plain vLLM server (vLLM's defaults, no connector) on the tiny model, as the benchmarks start it."""
    pytest.importorskip("vllm")
    import vllm_server

    log = tmp_path_factory.mktemp("chat-load-server") / "server.log"
    process, port = vllm_server.start_server(tiny_model_dir("llama"), log, 64 << 20,
                                             ["--max-model-len", "1024", "--max-num-seqs", "8"])
    yield f"http://127.0.0.1:{port}/v1/completions"
    vllm_server.stop_server(process)


def ended(output) -> float:
    """When a request's last streamed chunk came (perf_counter)."""
    return output.start_time + output.latency


@pytest.mark.vllm
def test_a_turn_is_sent_once_its_session_s_previous_turn_ended_and_rag_does_not_wait(plain_server, chat, rag):
    turns = chat.session(random.Random(5), session=0)
    # 64 tokens: a turn runs far longer than the 1 ms between arrivals, even with the client starved of
    # CPU by the server's threads
    targets = {kind: Target(plain_server, "tiny", fused=False, output_len=64) for kind in ("chat", "rag")}
    arrivals = [Arrival(0.0, "chat", turns[0]), Arrival(0.001, "chat", turns[1], after=0),
                Arrival(0.002, "rag", rag.prompt(random.Random(6), hit=True))]
    mixed = asyncio.run(mixed_open_loop(targets, arrivals, drain_s=120.0))
    first, second, rag_request = (sent.output for sent in mixed.run.sent)
    assert first.success and second.success and rag_request.success, (first.error, second.error, rag_request.error)
    assert second.start_time >= ended(first)
    assert mixed.held_s[1] > 0 and mixed.held_s[0] == mixed.held_s[2] == 0.0
    assert rag_request.start_time < ended(first)  # sent at its arrival, beside the running turn

    # negative control: a fresh session's second turn without its `after` is sent at its arrival, before
    # the first ended
    turns = chat.session(random.Random(7), session=1)
    unordered = asyncio.run(mixed_open_loop(targets, [Arrival(0.0, "chat", turns[0]), Arrival(0.001, "chat", turns[1])],
                                            120.0))
    first, second = (sent.output for sent in unordered.run.sent)
    assert first.success and second.success
    assert second.start_time < ended(first) and unordered.held_s == [0.0, 0.0]
