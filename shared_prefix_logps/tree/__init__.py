"""Prefix trees: every prefix the rows share, at any depth, forwarded once (``compute_logps_tree``,
``chunked_backward_tree``). Submodules: ``trie`` (the token trie), ``inputs`` (validation), ``plan`` (what each
forward holds), ``context``/``attention`` (inside the model's forward), ``forward`` (one forward of a set of
nodes), ``api``, ``chunked``, ``dense`` (the full-row reference)."""
