"""Memory pools shared by all sequences: paged K/V for attention layers, state slots for
recurrent layers, and the manager that says which sequence holds which (cache/manager.py).
Sequences own page ids and slot ids, never tensors."""
from blockspec.cache.kv_pool import KVPool, pages_for
from blockspec.cache.manager import CacheManager, DoubleFreeError, PageAllocator, SlotAllocator
from blockspec.cache.prefix import PrefixCache, PrefixCacheManager, PrefixHit, PrefixNode
from blockspec.cache.state_pool import StatePool

__all__ = ["CacheManager", "DoubleFreeError", "KVPool", "PageAllocator", "PrefixCache", "PrefixCacheManager", "PrefixHit",
           "PrefixNode", "SlotAllocator", "StatePool", "pages_for"]
