"""The three APIs (OpenAI's chat and completions, with vLLM's extensions and tokenizer routes;
OpenAI's Responses API; Anthropic Messages): their bodies read into a Prompt, their answers
written, log-probabilities, and the conversations kept between requests. Tool calling is in
tool_calls/."""
