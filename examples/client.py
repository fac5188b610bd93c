"""Ask a cachefuse-enabled vLLM server (examples/serve.sh) a RAG question over its OpenAI API.

Builds a `[system][chunk 1]...[chunk n][question]` prompt with the model's own tokenizer
(`cachefuse.rag_prompt.build_rag_prompt`, each piece tokenized on its own, so that the server's chunk
keys match the stored ones), then sends it twice:

- `/v1/completions` with `"prompt": token_ids` and `"kv_transfer_params": {"cachefuse": {"chunks": ...}}`;
- `/v1/chat/completions` with `"kv_transfer_params": {"prompt_token_ids": token_ids, "cachefuse": ...}`.

and prints each answer with the request's cachefuse figures, which come back in the response's
`kv_transfer_params`. Standard library only (urllib), plus transformers for the tokenizer.

    python examples/client.py --base-url http://127.0.0.1:8000 --model-dir /path/to/checkpoint
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cachefuse.rag_prompt import RagPrompt, build_rag_prompt  # noqa: E402

SYSTEM = "You answer questions using only the documents below.\n"
CHUNKS = (
    "Document 1: The river Kalo flows from the northern mountains to the harbour of Minteh.\n",
    "Document 2: The market of Minteh opens every Friday and sells fish, salt and lanterns.\n",
    "Document 3: The old bridge over the Kalo was built in 1784 and rebuilt after the flood of 1912.\n",
)
QUESTION = "Question: when was the bridge over the river Kalo built?\nAnswer:"
STATS = ("status", "chunks_hit", "chunks_missed", "tokens_reused", "tokens_recomputed", "bytes_loaded",
         "blend_time_s", "fallback_reason")


def post_json(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """POSTs `body` as JSON; raises RuntimeError with the server's message on an HTTP error."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"{url}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None


def complete(base_url: str, model: str, prompt: RagPrompt, max_tokens: int, timeout: float) -> dict[str, Any]:
    """/v1/completions: the prompt goes as token ids, the chunks as token offsets into them."""
    body = {"model": model, "prompt": prompt.token_ids, "max_tokens": max_tokens, "temperature": 0.0,
            "kv_transfer_params": prompt.kv_transfer_params()}
    response = post_json(f"{base_url}/v1/completions", body, timeout)
    return {"endpoint": "completions", "answer": response["choices"][0]["text"],
            "cachefuse": (response.get("kv_transfer_params") or {}).get("cachefuse")}


def chat(base_url: str, model: str, prompt: RagPrompt, question: str, max_tokens: int,
         timeout: float) -> dict[str, Any]:
    """/v1/chat/completions with the prompt pre-tokenized.

    vLLM's chat renderer pops `kv_transfer_params["prompt_token_ids"]` and sends those ids to the
    engine instead of rendering `messages` through the chat template (vllm 0.32:
    `vllm/renderers/online_renderer.py`, `_reused_prompt_token_ids`, called by
    `OnlineRenderer.preprocess_chat`). That keeps the chunk offsets valid; `messages` is still
    required by the API and only logged. Put any chat template's markup into the system and
    question texts yourself.
    """
    params = {"prompt_token_ids": prompt.token_ids, **prompt.kv_transfer_params()}
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0.0, "kv_transfer_params": params}
    response = post_json(f"{base_url}/v1/chat/completions", body, timeout)
    return {"endpoint": "chat", "answer": response["choices"][0]["message"]["content"],
            "cachefuse": (response.get("kv_transfer_params") or {}).get("cachefuse")}


def describe(result: dict[str, Any]) -> str:
    stats = result["cachefuse"] or {}
    figures = " ".join(f"{name}={stats[name]}" for name in STATS if name in stats)
    figures = figures or "none (the response has no kv_transfer_params: is the connector configured?)"
    return f"[{result['endpoint']}] answer: {result['answer']!r}\n[{result['endpoint']}] cachefuse: {figures}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--model-dir", required=True, help="the served checkpoint's directory (for its tokenizer)")
    parser.add_argument("--served-model-name", default=None, help="the server's model name (default: --model-dir)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    parser.add_argument("--json", action="store_true", help="print one JSON object per request")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    prompt = build_rag_prompt(tokenizer, SYSTEM, list(CHUNKS), QUESTION)
    base_url, model = args.base_url.rstrip("/"), args.served_model_name or args.model_dir
    results = [complete(base_url, model, prompt, args.max_tokens, args.timeout),
               chat(base_url, model, prompt, QUESTION, args.max_tokens, args.timeout)]
    for result in results:
        print(json.dumps(result) if args.json else describe(result))


if __name__ == "__main__":
    main()
