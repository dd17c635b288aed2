"""The replica's life: the supervisor that replaces a dead engine core (the spare, the kept KV
pool, requests that keep killing cores) and the drain at shutdown."""
