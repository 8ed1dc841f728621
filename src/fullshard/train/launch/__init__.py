"""How a run's ranks come to exist and agree: ``launcher.py`` (the launcher, torchrun in
process, and each worker's start and stop), ``cluster.py`` (what Slurm, Kubernetes and
the machine say about the job) and ``agreement.py`` (what every rank must share before it
trains)."""
