"""What outlives a process: the run folder's files, storage backends, the mirror, checkpoints and their
fencing.
"""
