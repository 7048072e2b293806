"""The block-manager machine: the driver that plays vLLM's scheduler against one block manager
(legacy BlockSpaceManager, V1 KVCacheManager, the reference), the stateful machine over it, its
strategies, the differential against the reference, and the incremental invariant check."""
