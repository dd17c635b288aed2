"""The Messages API's batches (/v1/messages/batches): many requests handed over at once, run
below every interactive request, their results fetched later."""
