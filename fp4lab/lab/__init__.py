"""The orchestration layer: sweep specs, Slurm jobs, log scanning, the run catalog, the ratchet and reports.

Nothing here imports torch at module level, so CLI commands built on it stay fast.
"""
