"""Who may call, from where and how many: API keys and tenants, the gateway's admission bounds,
connection limits, CORS and the Host check."""
