"""fp4lab.train: the training loop, its data, checkpoints and metrics.

Import the submodules directly (`from fp4lab.train.data import load_dataset`): this package imports
nothing, so importing it never pulls in torch.
"""
