"""Shared test fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: a second intra-op thread only adds synchronisation, and on a
    loaded 2-core machine spinning OpenMP threads made such modules several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
