"""Throughput benchmarks for the OpenAI chat endpoint (mlxd against mlx_lm.server)."""
