"""Memory pools shared by all sequences: paged K/V for attention layers, state slots for
recurrent layers. Sequences own page ids and slot ids, never tensors."""
from blockspec.cache.kv_pool import KVPool, PageAllocator, pages_for
from blockspec.cache.prefix import PrefixCache, PrefixHit, PrefixNode
from blockspec.cache.state_pool import StatePool

__all__ = ["KVPool", "PageAllocator", "PrefixCache", "PrefixHit", "PrefixNode", "StatePool", "pages_for"]
