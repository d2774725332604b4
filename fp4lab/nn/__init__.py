"""fp4lab.nn: the layers FP4 recipes train: FP4 linear, attention (with probes and FP4 attention), Llama decoder."""
