"""Tiny trained MoE models: a character tokenizer, the VL processor, configs and training (their tasks
come from evalsuite.taskgen)."""
