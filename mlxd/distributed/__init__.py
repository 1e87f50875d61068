"""One model over a group of ranks: config checks, mlx.launch argv, rank-0 broadcast, sharding.

Modules: `config` (rank count and model geometry checks), `launch` (hostfile and argv for
mlx.launch), `broadcast` (rank 0's step commands to every rank), `pipeline` (layer split for the
llama family), `shard` (load one rank's part of a model). Only `launch` and `config` avoid
importing mlx at module level, so the daemon can use them without loading MLX.
"""
