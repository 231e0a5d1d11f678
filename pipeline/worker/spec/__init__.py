"""Worker stage, speculative decoding: the proposers that draft tokens without weights
(n-gram prompt lookup, suffix decoding) behind one interface (proposer.py)."""
