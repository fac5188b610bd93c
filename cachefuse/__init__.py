"""cachefuse: position-independent chunk KV caches fused into vLLM prefills.

Importing this package touches no device and imports neither vllm nor triton.
"""

__version__ = "0.1.0"
