"""Fault experiments (`tokstream chaos`), installed as `tokstream.chaos`. Imports no torch."""
