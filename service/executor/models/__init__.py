"""Sluice's own model implementations (the Llama family), built from transformers configs and checkpoint weights."""
