"""What vLLM and vllm-router say and accept: payload validation, routes and refusals; pure, no I/O."""
