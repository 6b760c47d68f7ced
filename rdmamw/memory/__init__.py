"""Memory for large messages: the registration cache, the buffer pools and the
rendezvous thresholds (docs/memory.md)."""
