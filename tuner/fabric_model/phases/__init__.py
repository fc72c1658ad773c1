"""The fabric model's phases, one module per transport: the MODELLED cost of a dispatch or a combine."""
