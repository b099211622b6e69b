"""What vLLM and vllm-router say and accept: payload checks, routes, refusals and how its answers read; pure, no I/O."""
