"""Model backends behind one contract (base.py). batching/ and server/ never import a concrete one."""

from .llamacpp.openmp import apply_default_wait_policy

apply_default_wait_policy()  # before any backend module imports llama_cpp (which loads libgomp)
