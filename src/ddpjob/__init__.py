"""ddpjob: one torchrun-compatible DDP training job for laptops, Docker, Slurm and Kubernetes."""

__version__ = "0.1.0"
