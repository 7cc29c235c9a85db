"""Observability: metrics, experiment tracking and the run's report.
"""
