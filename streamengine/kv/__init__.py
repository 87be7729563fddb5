"""The paged KV cache's bookkeeping: blocks, refcounts, prefix hashes, swap, pins, events. Imports no torch."""
