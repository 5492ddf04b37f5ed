"""Activation memory: how many decoder layers keep their activations (`checkpoint_fitter.py`,
`fastqwen_checkpointing: auto`) and what a kept layer holds (`lean_activations.py`)."""
