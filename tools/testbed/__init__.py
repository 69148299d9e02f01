"""A multi-host cluster on one machine: network namespaces, shaped veth links, real SLURM."""
