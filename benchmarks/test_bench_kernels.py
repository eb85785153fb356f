"""The kernel microbenchmark's fused-head chunk: the one ``linear_logps`` picks on CUDA, not the CPU budget."""

import torch
from bench_kernels import head_chunk_rows

from shared_prefix_logps.kernels.fused_head import default_chunk_size


def test_head_chunk_is_the_cuda_default(monkeypatch):
    gib = 2**30
    # An 80 GiB device after a first step: 8 GiB free, 60 GiB reserved by the caching allocator but unused.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 70 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * gib)
    cuda = torch.device("cuda", 0)
    n, vocab = 8192, 151936
    rows, chosen = head_chunk_rows(n, vocab, cuda)
    assert rows == default_chunk_size(n, vocab, device=cuda) == n  # 8 GiB hold 14,128 rows: one chunk
    assert rows != default_chunk_size(n, vocab) == 441  # the CPU budget, 256 MiB
    assert "68.0 GiB available" in chosen
    rows, chosen = head_chunk_rows(10**5, vocab, cuda)
    assert rows == 14080 and rows % 128 == 0
    assert head_chunk_rows(n, vocab, cuda, requested=1024) == (1024, "--chunk-size")
