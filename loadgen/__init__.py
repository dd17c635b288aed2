"""Locust-driven load generation (`tokstream loadtest`), installed as `tokstream.loadgen`."""
