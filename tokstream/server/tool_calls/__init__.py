"""Tool calling, for every API: the neutral shapes (tools.py), each API's request and output
shapes (openai_tools.py, anthropic_tools.py), the tools in the prompt (tool_template.py) and
the calls in the output (tool_parser.py)."""
