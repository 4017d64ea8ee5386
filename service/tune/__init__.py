"""``gateway tune``: search the batching settings (policy, batch size, delay, in-flight batches,
workers) against a running backend for the most throughput within a p99 target, and write them
as an env file with a report. See :mod:`service.tune.search` for the search."""
