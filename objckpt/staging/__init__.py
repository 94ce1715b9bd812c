"""Host staging buffers for uploads."""
