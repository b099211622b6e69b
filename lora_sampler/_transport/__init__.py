"""One exchange with an engine and one whole answer, translated into lora_sampler's errors."""
