"""Streams: the registry and demux of every live request, each caller's bounded channel, the SSE
writer and the non-streaming collection."""
