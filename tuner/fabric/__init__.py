"""The fabric as found: facts, discovery from live/captured machines, fingerprint, transport families."""
