"""The worker's process: the Ray actor, its replica (the step loop and the phases it owns: committed
state, epoch entry, data feed, reports), building the workload, the data sources and loader, the Ray
Data holder, and the cluster probe's actors.
"""
