"""Tiny trained MoE models: synthetic skill generators, a character tokenizer, configs and training."""
