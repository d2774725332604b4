"""What a user writes: sweep specs (`sweep_spec`) and ratchet programs (`program`), validated."""
