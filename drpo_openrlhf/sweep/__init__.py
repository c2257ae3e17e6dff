"""``drpo-sweep``: a grid of methods x parameters x seeds trained, evaluated and reported as
the paper's frontier, on Slurm (a job array), Ray (one job per run) or locally (docs/sweep.md)."""
