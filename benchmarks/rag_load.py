"""The load benchmarks/serving_load.py puts on a server: RAG prompts, their arrival times, and the clients
that send them (Poisson arrivals, a closed loop, one at a time).

A prompt is token ids (the bench models have random weights, so text means nothing to them):

    | system (24) | document | document | document | question (10) |
    0                                                                N

Documents come from a pool that is stored before measuring; a miss swaps one of them for a never-seen
document of the same length range. A fused request declares the system prompt and every document as
chunks (`kv_transfer_params = {"cachefuse": {"chunks": [[start, end], ...]}}`, as benchmarks/soak.py
does); a plain one sends the same ids without them.

Requests go through vLLM's own benchmark client (`vllm/benchmarks/lib/endpoint_request_func.py`:
`async_request_openai_completions`, streamed, with TTFT, ITL and latency measured the way `vllm bench
serve` measures them); `kv_transfer_params` and `temperature` ride in its `extra_body`. Arrival times are
drawn here, not by `vllm.benchmarks.serve.get_request`: that generator takes its gaps from numpy's global
random state and rescales them so that a given number of requests spans exactly num/rate seconds, while
a load point here is a fixed window of seconds whose schedule is drawn once per seed (identical for every
configuration) and can be checked without sleeping. The gaps are the same distribution as get_request's
with burstiness 1 (exponential, mean 1/rate).

Imports vllm only inside the functions that send requests. Not a script.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import aiohttp
    from tqdm import tqdm
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

SYSTEM_TOKENS = 24
QUESTION_TOKENS = 10
TOKEN_IDS = (3, 1000)  # clear of the tokenizer's special tokens and inside every bench model's vocabulary
STORE_QUESTION = [5]  # the one-token question of the requests that store the documents


@dataclass(frozen=True)
class RagPrompt:
    ids: list[int]
    chunks: list[list[int]]
    """[start, end) of the system prompt and of each document, in prompt order."""
    hit: bool
    """Every document is one of the stored pool."""


def random_ids(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(*TOKEN_IDS) for _ in range(num_tokens)]


def assemble(system: list[int], documents: list[list[int]], question: list[int], hit: bool) -> RagPrompt:
    """[system][documents...][question], with the system prompt and each document declared as a chunk."""
    ids, chunks = list(system), [[0, len(system)]]
    for document in documents:
        chunks.append([len(ids), len(ids) + len(document)])
        ids += document
    return RagPrompt(ids + question, chunks, hit)


class RagWorkload:
    """A system prompt and a pool of documents; prompts of `docs_per_prompt` of them in random orders."""

    def __init__(self, doc_lengths: tuple[int, int], num_docs: int = 12, docs_per_prompt: int = 3,
                 seed: int = 0) -> None:
        if not 1 <= docs_per_prompt <= num_docs:
            raise ValueError(f"docs_per_prompt={docs_per_prompt}, expected 1..num_docs={num_docs}")
        rng = random.Random(seed)
        self.doc_lengths = doc_lengths
        self.docs_per_prompt = docs_per_prompt
        self.system = random_ids(rng, SYSTEM_TOKENS)
        self.docs = [random_ids(rng, rng.randint(*doc_lengths)) for _ in range(num_docs)]

    def prompt(self, rng: random.Random, hit: bool) -> RagPrompt:
        """Stored documents in a random order and a new question; a miss swaps one for a never-seen one."""
        documents = rng.sample(self.docs, self.docs_per_prompt)
        if not hit:
            documents[rng.randrange(len(documents))] = random_ids(rng, rng.randint(*self.doc_lengths))
        return assemble(self.system, documents, random_ids(rng, QUESTION_TOKENS), hit)

    def draw(self, rng: random.Random, hit_rate: float) -> RagPrompt:
        """A prompt that is a hit with probability `hit_rate`."""
        return self.prompt(rng, hit=rng.random() < hit_rate)

    def storing_prompts(self) -> list[RagPrompt]:
        """One prompt per pool document (system + document + one token), as `cachefuse precompute` would store them."""
        return [assemble(self.system, [document], STORE_QUESTION, hit=True) for document in self.docs]

    def max_prompt_tokens(self) -> int:
        return SYSTEM_TOKENS + self.docs_per_prompt * self.doc_lengths[1] + QUESTION_TOKENS


def poisson_arrivals(rate: float, duration_s: float, seed: int) -> list[float]:
    """Arrival offsets in seconds of a Poisson process at `rate` requests/s over [0, duration_s)."""
    if rate <= 0:
        raise ValueError(f"rate={rate!r}, expected > 0")
    rng = random.Random(seed)
    arrivals, at = [], rng.expovariate(rate)
    while at < duration_s:
        arrivals.append(at)
        at += rng.expovariate(rate)
    return arrivals


@dataclass(frozen=True)
class Target:
    """Where and how requests go: the completions URL, the served model's name, fused or plain, and how
    many tokens to generate."""

    url: str
    model: str
    fused: bool
    output_len: int


@dataclass
class Sent:
    """One request as sent: when (seconds after the run's start) and vLLM's record of its outcome."""

    at_s: float
    output: RequestFuncOutput


@dataclass
class Run:
    """The requests of one run and its length: from its start until the last request ended or was cancelled."""

    sent: list[Sent]
    elapsed_s: float


def client_session() -> aiohttp.ClientSession:
    """A session with no connection limit: an arrival is never queued in the client."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import AIOHTTP_TIMEOUT

    return aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=aiohttp.TCPConnector(limit=0))


async def send(session: aiohttp.ClientSession, target: Target, prompt: RagPrompt,
               pbar: tqdm | None = None) -> RequestFuncOutput:
    """One streamed completion through vLLM's benchmark client (greedy, ignore_eos). Only a fused target
    reads `prompt.chunks`: any prompt with `ids` goes to a plain one (benchmarks/chat_load.py's turns)."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    extra_body: dict = {"temperature": 0.0}
    if target.fused:
        extra_body["kv_transfer_params"] = {"cachefuse": {"chunks": prompt.chunks}}
    request = RequestFuncInput(prompt=prompt.ids, api_url=target.url, prompt_len=len(prompt.ids),
                               output_len=target.output_len, model=target.model, extra_body=extra_body,
                               ignore_eos=True)
    return await async_request_openai_completions(request, session, pbar)


def unfinished(started: float) -> RequestFuncOutput:
    """The record of a request cancelled because it was still running at the drain deadline."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    return RequestFuncOutput(success=False, error="unfinished at the drain deadline", start_time=started)


async def wait_until(tasks: list[asyncio.Task], deadline: float) -> None:
    """Waits for `tasks` until perf_counter() reaches `deadline`, then cancels the rest (vLLM aborts a
    request whose client hangs up)."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        _, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def open_loop(target: Target, prompts: list[RagPrompt], arrivals: list[float], drain_s: float,
                    pbar: tqdm | None = None) -> Run:
    """Sends prompts[i] at arrivals[i] seconds whatever is still running, then waits at most `drain_s` for
    the stragglers; those still running are cancelled and recorded as failed."""
    return await scheduled(arrivals, lambda session, i, _: send(session, target, prompts[i], pbar), drain_s)


async def scheduled(arrivals: list[float], start: Callable[[aiohttp.ClientSession, int, list[asyncio.Task]],
                                                           Awaitable[RequestFuncOutput]], drain_s: float) -> Run:
    """The open loop: at arrivals[i] seconds, whatever is still running, starts the task `start(session, i,
    tasks)` (`tasks`: those started so far, by index; one may wait for an earlier one, as a chat session's
    turns keep their order), then waits at most `drain_s` for the stragglers; those still running are
    cancelled and recorded as failed. Run.sent is in arrival order."""
    async with client_session() as session:
        begin = time.perf_counter()
        tasks: list[asyncio.Task] = []
        for index, at in enumerate(arrivals):
            await asyncio.sleep(max(0.0, begin + at - time.perf_counter()))
            tasks.append(asyncio.create_task(start(session, index, tasks)))
        await wait_until(tasks, time.perf_counter() + drain_s)
        elapsed_s = time.perf_counter() - begin
    sent = [Sent(at, unfinished(begin + at) if task.cancelled() else task.result())
            for at, task in zip(arrivals, tasks, strict=True)]
    return Run(sent, elapsed_s)


async def closed_loop(target: Target, next_prompt: Callable[[int], RagPrompt], clients: int, duration_s: float,
                      drain_s: float, pbar: tqdm | None = None) -> Run:
    """`clients` clients, each sending its next request (`next_prompt(client index)`) as soon as its last
    one is answered, for `duration_s`; requests still running `drain_s` later are cancelled and recorded
    as failed. `pbar` counts answered requests (it needs no total)."""
    sent: list[Sent] = []

    async def client(session: aiohttp.ClientSession, index: int) -> None:
        while (at := time.perf_counter() - start) < duration_s:
            try:  # vLLM's client would test a bar without a total for truth, which tqdm refuses
                sent.append(Sent(at, await send(session, target, next_prompt(index))))
            except asyncio.CancelledError:
                sent.append(Sent(at, unfinished(start + at)))
                raise
            if pbar is not None:
                pbar.update()

    async with client_session() as session:
        start = time.perf_counter()
        tasks = [asyncio.create_task(client(session, i)) for i in range(clients)]
        await wait_until(tasks, start + duration_s + drain_s)
        elapsed_s = time.perf_counter() - start
    for task in tasks:  # a client's own failure (not a failed request: those are records) ends the run
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    return Run(sent, elapsed_s)


async def one_at_a_time(target: Target, prompts: list[RagPrompt]) -> list[RequestFuncOutput]:
    """Each prompt alone on the server, the next sent when the last is answered."""
    async with client_session() as session:
        return [await send(session, target, prompt) for prompt in prompts]
