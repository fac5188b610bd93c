"""Run by test_async_scheduling.py in its own process: an engine with async scheduling on (as on a GPU),
one fused request whose blend pass raises, then one more request. argv: model_dir store_dir mode, where
mode "async_loads" keeps cachefuse's rule (every blend an asynchronous load) and "sync_loads" breaks it
(blends synchronous, their failure reported as load errors after vLLM scheduled the next step).
Prints RESULT {json} when the engine survives both requests."""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.helpers.vllm_engines import (  # noqa: E402 - after the path
    generate,
    named_prompt,
    precompute,
    random_pieces,
    scheduler_connector,
    start_engine,
    worker_side,
)


def main() -> None:
    model_dir, store_dir, mode = sys.argv[1:4]
    llm = start_engine(model_dir, store_dir, async_scheduling=True, selector="full_reuse")
    pieces = random_pieces(5, {"system": 10, "a": 33, "c": 27, "question": 9})
    precompute(llm, pieces["system"], [pieces["a"], pieces["c"]])
    scheduler_connector(llm)._scheduler.planner.async_scheduling = mode == "async_loads"
    fusor = worker_side().engine.fusor
    working = fusor.fuse_steps

    def broken(*args, **kwargs):
        raise RuntimeError("injected failure")

    fusor.fuse_steps = broken
    ids, params = named_prompt(pieces, ("system", "a", "c", "question"))
    (failed,) = generate(llm, [ids], [params], max_tokens=4)
    fusor.fuse_steps = working
    (fused,) = generate(llm, [ids], [params], max_tokens=4)
    print("RESULT " + json.dumps({"failed": failed.kv_transfer_params["cachefuse"],
                                  "fused": fused.kv_transfer_params["cachefuse"],
                                  "failed_tokens": list(failed.outputs[0].token_ids)}), flush=True)


if __name__ == "__main__":
    main()
