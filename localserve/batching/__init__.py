"""The continuous-batching scheduler: pure Python over the Backend contract."""
