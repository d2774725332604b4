"""The lab's enumerated choices, in a module that imports nothing: `fp4lab --help` lists them, and
the modules that act on them (fp4lab.lab.runs.executors, fp4lab.lab.ratchet) import far more."""

SWEEP_EXECUTORS = ("local", "slurm", "sbatch")  # how `fp4lab sweep` runs a sweep's runs
RATCHET_EXECUTORS = ("local", "slurm")  # how the ratchet runs each experiment
PROPOSERS = ("optuna", "llm", "command")  # what proposes the ratchet's next change
