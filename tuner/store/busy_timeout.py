"""How long a store waits for another process's lock, and when a write that waits says so."""

BUSY_TIMEOUT_S = 30.0
# a write that has waited this long for another process's lock says so (once) on stderr, then waits on to BUSY_TIMEOUT_S
NOTICE_AFTER_S = 2.0
# a write waits for the lock in slices this long (SQLite's own wait cannot be interrupted: sqlite3_interrupt does not end
# it), so that a process that stops (`Store.stop_waiting`) gives a waiting write up within one slice
WAIT_SLICE_S = 0.1
