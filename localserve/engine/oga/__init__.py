"""onnxruntime-genai (OGA) folders served by OGA's own batching engine behind engine_api.ModelEngine.

`loader.build_oga_engine(folder)` makes a started engine from a folder (the benchmark's entry);
`loader.load_oga_engine` is the backend registry's loader for a stored `oga` variant.
"""
