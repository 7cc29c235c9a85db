"""The per-worker policies (torch, no Ray): each synchronization policy's step logic and its building
blocks.
"""
