"""The two APIs (OpenAI, with vLLM's extensions and tokenizer routes; Anthropic Messages): their
bodies read into a Prompt, their answers written, tool calling and log-probabilities."""
