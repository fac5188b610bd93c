"""The scheduler half of CacheFuseConnector, split by job (docs/architecture.md, Packages and modules).

- hooks.py: `SchedulerSide`, vLLM's scheduler hooks, each converting and calling one of the others;
- planning.py: plans, replays after preemption, the per-step blend budget, the BlendPlans sent;
- gate.py: the loading controller's go/no-go and ratio per request, and the model's K/V geometry;
- outcomes.py: per-request outcomes, the response's `kv_transfer_params["cachefuse"]`, and counting;
- index.py: the variant index, loaded at start-up and kept current by a background thread.

Runs inside vLLM's `Scheduler.schedule()` hot path: no tensors, no network, no file reads per request.
Imports nothing: a package whose __init__ imports its own modules closes an import cycle with each.
"""
