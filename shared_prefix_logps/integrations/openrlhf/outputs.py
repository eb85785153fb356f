"""What the patched ``Actor.forward`` returns beside the log-probs when OpenRLHF asks for ``return_output=True``."""

from __future__ import annotations

import torch


class SharedPrefixActorOutput(dict):
    """The second element of ``(action_log_probs, output)``: what OpenRLHF's trainer reads from it, nothing more.

    OpenRLHF's training step reads ``output.entropy[:, -A:]`` (with ``return_entropy=True``), weighted by
    ``action_mask``. ``entropy`` is ``(B, S - 1)`` float32 like OpenRLHF's, exact at every position a completion token
    is predicted from and 0.0 at prompt and padding positions (the shared path computes no prompt logits). There are no
    ``logits``: asking for them raises instead of returning something else; calls that want logits go to OpenRLHF's own
    forward (the patch falls back when ``action_mask`` is None).
    """

    def __init__(self, entropy: torch.Tensor | None):
        super().__init__()
        if entropy is not None:
            self["entropy"] = entropy

    def __getattr__(self, name):
        if name in self:
            return self[name]
        raise AttributeError(self._missing(name))

    def __getitem__(self, key):
        if key not in self:
            raise KeyError(self._missing(key))
        return super().__getitem__(key)

    @staticmethod
    def _missing(name) -> str:
        if name == "entropy":
            return "entropy was not requested: call the actor with return_entropy=True"
        return (
            f"the shared-prefix actor output has no {name!r} (it never materializes logits); unpatch the actor "
            "(unpatch_actor) for callers that need the model's full output"
        )
