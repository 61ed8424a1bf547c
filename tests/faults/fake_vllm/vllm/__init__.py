"""A fake vLLM for the fault suite (see tests/faults/fake_vllm/vllm/entrypoints/openai/api_server.py)."""
