"""How figures are measured: clients, datasets, deployments, load generators, scenarios and cases,
reports.

Tests may import these; each figure is a module one level up (``python -m loadtests.<figure>``).
"""
