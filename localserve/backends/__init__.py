"""Model backends behind one contract (base.py). batching/ and server/ never import a concrete one."""
