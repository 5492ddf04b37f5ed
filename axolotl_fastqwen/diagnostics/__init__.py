"""What a user runs on their own machine to see what will run there: `python -m axolotl_fastqwen
doctor` (`doctor.py`), at the published model shapes (`model_shapes.py`). The run's own report is
`python -m axolotl_fastqwen report` (integration/report_command.py)."""
