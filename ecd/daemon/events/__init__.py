"""[events]: what this node holds, published as vLLM KV events (docs/events.md). wire.py: vLLM's
structs; publisher.py: the thread owning the sockets; feed.py: the loop's listener; service.py:
`Events`, which ties them to the daemon."""
