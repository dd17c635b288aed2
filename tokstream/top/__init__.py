"""tokstream top: a live Textual view of a running server (HTTP only; no engine, no torch)."""
