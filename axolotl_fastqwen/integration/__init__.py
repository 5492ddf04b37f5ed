"""Everything that talks to Axolotl, and nothing else in the package does (tested): the plugin's
hooks (`plugin`), its config keys (`keys`) and their reading into one `Settings` (`settings`), what
becomes of Axolotl's own speed options (`axolotl_options`), the bare-name alias (`bare_name`), the
trainer callbacks (`callbacks`), the packer's wiring into Axolotl's trainer (`trainer_packing`) and
`python -m axolotl_fastqwen report` (`report_command`). Importing this package imports nothing.
"""
