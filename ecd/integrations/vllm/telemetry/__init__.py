"""vLLM's connector API beyond transfers, for ecd's connectors: statistics in vLLM's metrics
(stats.py), the blocks ecd stored in vLLM's KV event stream (kv_events.py), handshake metadata
(handshake.py); recorders.py counts, hooks.py holds the connector methods. docs/vllm.md explains.
Import the modules themselves (this package imports nothing: no import circle)."""
