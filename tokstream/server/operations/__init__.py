"""Operations: /health, /metrics, /v1/state (its snapshots, events, host figures), the admin
routes and the published OpenAPI schema."""
