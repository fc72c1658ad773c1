"""Finding tuned settings at run time: the daemon client, the fallback chain, launcher environment and policy defaults."""
