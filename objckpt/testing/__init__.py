"""Test and benchmark helpers for objckpt; save and load never use them (``objckpt demo`` counts requests with ``stores``)."""
