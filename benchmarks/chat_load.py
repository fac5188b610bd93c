"""Multi-turn chat beside RAG: the chat sessions, the mixed arrival schedule of benchmarks/mixed_load.py,
and its open loop, in which a session's turns keep their order.

A chat turn is the session's history and a new user message, token ids, no cachefuse parameters:

    | chat system (32) | user 1 | reply 1 | user 2 | reply 2 | ... | user k |
    0                                                                      N

Turn k+1's prompt starts with turn k's whole prompt, a shared prefix that grows with every turn and that
vLLM's prefix cache serves (up to turn k's last full block: the reply in the history is drawn, not the
tokens the model generated, which vLLM also cached; the bench models have random weights, so what they
generate means nothing). A reply has the length a turn generates (--output-len), so a history grows as a
chat's does. Every session opens with the same system prompt (one chat application); a session ends
after its last turn and a fresh one takes its place.

Arrivals are one Poisson process (benchmarks/rag_load.py) whose requests are chat turns with probability
`chat_share` and RAG prompts otherwise. A chat turn goes to one of `num_sessions` live sessions, at
random; a turn that arrives while its session's previous turn is still running waits for it (a user reads
the answer before writing the next message): the wait is not part of its TTFT, and the report counts the
turns that waited. Everything is drawn from the point's seed, so every configuration gets the same
requests at the same times.

Imports vllm only through benchmarks/rag_load.py's request functions. Not a script.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import rag_load
from rag_load import RagPrompt, RagWorkload, Target, poisson_arrivals, random_ids

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

CHAT_SYSTEM_TOKENS = 32
USER_LENGTHS = {"tiny": (20, 40), "bench": (40, 120)}  # tokens of a user message, by model size


@dataclass(frozen=True)
class ChatTurn:
    ids: list[int]
    """The session's history and the turn's user message."""
    session: int
    turn: int
    """0 for a session's first turn."""


class ChatWorkload:
    """The chat application: one system prompt; sessions of `turns_per_session` turns."""

    def __init__(self, user_lengths: tuple[int, int], reply_tokens: int, turns_per_session: int,
                 seed: int = 0) -> None:
        if turns_per_session < 1 or reply_tokens < 1:
            raise ValueError(f"turns_per_session={turns_per_session}, reply_tokens={reply_tokens}: expected >= 1")
        self.user_lengths = user_lengths
        self.reply_tokens = reply_tokens
        self.turns_per_session = turns_per_session
        self.system = random_ids(random.Random(f"chat/{seed}"), CHAT_SYSTEM_TOKENS)

    def session(self, rng: random.Random, session: int) -> list[ChatTurn]:
        """Every turn of one session: turn k+1's ids are turn k's, a drawn reply and a new user message."""
        history, turns = list(self.system), []
        for turn in range(self.turns_per_session):
            history += random_ids(rng, rng.randint(*self.user_lengths))
            turns.append(ChatTurn(list(history), session, turn))
            history += random_ids(rng, self.reply_tokens)
        return turns

    def max_prompt_tokens(self) -> int:
        return (CHAT_SYSTEM_TOKENS + self.turns_per_session * self.user_lengths[1]
                + (self.turns_per_session - 1) * self.reply_tokens)


@dataclass(frozen=True)
class Arrival:
    at_s: float
    kind: str
    """"chat" or "rag"."""
    prompt: ChatTurn | RagPrompt
    after: int | None = None
    """The index of the arrival this one waits for (its session's previous turn), if any."""


@dataclass(frozen=True)
class MixedLoad:
    """What one point sends: the Poisson rate (requests/s of both classes), the chat share, how many chat
    sessions are live at a time, and the RAG hit rate."""

    rate: float
    chat_share: float
    num_sessions: int
    hit_rate: float = 1.0


def mixed_schedule(load: MixedLoad, duration_s: float, chat: ChatWorkload, rag: RagWorkload, seed: str) -> list[Arrival]:
    """The point's arrivals over [0, duration_s): chat turns (in order within each session) and RAG prompts."""
    if not 0.0 <= load.chat_share <= 1.0 or load.num_sessions < 1:
        raise ValueError(f"chat_share={load.chat_share}, num_sessions={load.num_sessions}: expected 0..1 and >= 1")
    rng = random.Random(seed)
    live: list[list[ChatTurn]] = [[] for _ in range(load.num_sessions)]  # each slot's turns still to come
    last: list[int | None] = [None] * load.num_sessions  # each slot's last arrival index
    num_sessions = 0
    arrivals = []
    for at_s in poisson_arrivals(load.rate, duration_s, seed):
        if rng.random() >= load.chat_share:
            arrivals.append(Arrival(at_s, "rag", rag.draw(rng, load.hit_rate)))
            continue
        slot = rng.randrange(load.num_sessions)
        if not live[slot]:  # the slot's session ended (or none began): a fresh one
            live[slot], last[slot] = chat.session(rng, num_sessions), None
            num_sessions += 1
        arrivals.append(Arrival(at_s, "chat", live[slot].pop(0), after=last[slot]))
        last[slot] = len(arrivals) - 1
    return arrivals


@dataclass
class MixedRun:
    """A mixed point as run: vLLM's records in arrival order, and how long each turn waited for its
    session's previous one (0 for those that did not)."""

    run: rag_load.Run
    held_s: list[float]


async def mixed_open_loop(targets: dict[str, Target], arrivals: list[Arrival], drain_s: float,
                          pbar: tqdm | None = None) -> MixedRun:
    """Sends each arrival to `targets[arrival.kind]` at its time, a chat turn once its session's previous
    turn has ended (whether it succeeded or not: a failure is its own record)."""
    held_s = [0.0] * len(arrivals)

    async def start(session: aiohttp.ClientSession, index: int, tasks: list[asyncio.Task]) -> RequestFuncOutput:
        arrival = arrivals[index]
        if arrival.after is not None and not tasks[arrival.after].done():
            began = time.perf_counter()
            await asyncio.wait([tasks[arrival.after]])
            held_s[index] = time.perf_counter() - began
        return await rag_load.send(session, targets[arrival.kind], arrival.prompt, pbar)

    run = await rag_load.scheduled([a.at_s for a in arrivals], start, drain_s)
    return MixedRun(run, held_s)
