"""Merging partial attention results by log-sum-exp (context parallelism's pieces)."""
