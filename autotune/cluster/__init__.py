"""Trials that span nodes: the same `autotune search` started once per node by torchrun or srun. Node 0 runs the
study; the others are agents that fork their local ranks for each trial (env: who am I; node: the protocol)."""
