"""How long a store waits for another process's lock, and when a write that waits says so."""

BUSY_TIMEOUT_S = 30.0
# a write that has waited this long for another process's lock says so (once) on stderr, then waits on to BUSY_TIMEOUT_S
NOTICE_AFTER_S = 2.0
