"""Running sweeps: planning (`sweep`), SBATCH scripts (`sbatch`), Slurm and the executors, what runs inside a job (`job`), Optuna trials (`trials`)."""
