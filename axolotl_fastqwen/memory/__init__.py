"""Activation memory: how many decoder layers keep their activations (`checkpoint_fitter.py`,
`fastqwen_checkpointing: auto`), what a kept layer holds (`lean_activations.py`), and what CUDA graph pools
hold beside the allocated counters the fitter reads (`graph_pools.py`)."""
