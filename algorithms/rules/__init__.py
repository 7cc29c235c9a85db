"""The torch-free rules the coordinator uses (numpy at most, no torch, no Ray): supervision's
decisions, membership, stragglers, policy kinds, topologies, ZipLine, leases, the sampler and the
runtime model.
"""
