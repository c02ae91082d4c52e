"""Cache pools: per-kind geometry, sizing from budgets, KV and state pools."""
