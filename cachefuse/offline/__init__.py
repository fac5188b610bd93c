"""Offline work that fills the chunk store ahead of serving.

`precompute.py` stores each chunk's base variant (computed after the system prompt alone) through a
connector-enabled vLLM engine. Neighbour fusion, anchors and critical-layer profiling will join it
here. Importing this package imports neither vllm nor torch: the functions that drive an engine
import what they need.
"""
