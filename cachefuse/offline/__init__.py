"""Offline work that fills the chunk store ahead of serving.

`precompute.py` stores each chunk's base variant (computed after the system prompt alone) through a
connector-enabled vLLM engine. `neighbours.py` (FusionRAG's offline stage) also stores each chunk
computed after its most similar chunks, on the reference engine. `layer_profile.py` measures QCFuse's
critical layers per model and stores them beside the chunks (`cachefuse profile-layers`).
`neighbour_precompute.py` stores the neighbour variants through vLLM (`precompute --fuse-neighbours`);
`anchors.py` chooses QCFuse's anchors per chunk (key-norm or attention ranking) and stores them in the
chunk's metadata. Importing this package imports neither vllm nor torch: the functions that drive an
engine import what they need.
"""
