"""cachefuse's vLLM integration: the only package that imports vllm."""
