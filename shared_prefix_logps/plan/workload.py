"""What is run (the workload) and where (the engine), with the checks that name a bad option."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Bytes per element of the dtypes ``plan`` knows.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
WORKLOADS = ("score", "train")
ENGINES = ("single", "fsdp2", "zero3")
#: Optimizer state bytes per trainable parameter: AdamW keeps two float32 moments; SGD none.
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 0}
#: ``cpu``: the quantity ``bench --device cpu`` measures (peak live tensor bytes inside one step: parameters and
#: the optimizer excluded, gradients included); ``cuda``: a training process's peak allocated bytes per device.
DEVICES = ("cuda", "cpu")
#: Implementations of the fused head's statistics (``kernels.implementation``): the Triton kernels work in the
#: logits' buffer; the torch one holds float32 temporaries beside it.
HEAD_IMPLEMENTATIONS = ("triton", "torch")


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class Workload:
    """One step's batch: B prompts of P tokens (left-padded width), G completions each of C tokens.

    Attributes:
        prompts, prompt_len, completion_len, generations: B, P, C, G.
        mode: ``score`` (no gradients) or ``train`` (log-probs with gradients and their backward).
        dtype: ``bf16``, ``fp16`` or ``fp32``, the parameters' and activations' dtype.
        gradient_checkpointing: each decoder layer saves only its input and recomputes the rest in backward.
        lora_fraction: trainable share of the parameters (None: full training); LoRA trains a small share.
        optimizer: ``adamw`` or ``sgd`` (its states are counted on ``cuda`` only).
        scored_tokens: completion tokens that are real (not padding), all of them when None; the fused heads
            only compute these.
        prompt_tokens: real prompt tokens (None: all B x P); used by FLOP floors.
        generations_per_chunk: ``chunked_backward``'s chunk (None: G // 4, as the bench runs it).
        padded_prompts: whether some prompt is left-padded. ``expand`` then builds the completions' node call a mask
            per row; unpadded prompts (without a window shorter than the keys) share one row's mask. True unless
            known otherwise: the larger prediction.
        token_budget: ``compute_logps``'s ``token_budget``: without gradients, the most tokens (with ``expand``, its
            memory terms counted as tokens) a chunk of rows forwards at once (None: ``DEFAULT_TOKEN_BUDGET``).
    """

    prompts: int
    prompt_len: int
    completion_len: int
    generations: int
    mode: str = "train"
    dtype: str = "bf16"
    gradient_checkpointing: bool = False
    lora_fraction: float | None = None
    optimizer: str = "adamw"
    scored_tokens: int | None = None
    prompt_tokens: int | None = None
    generations_per_chunk: int | None = None
    padded_prompts: bool = True
    token_budget: int | None = None

    def __post_init__(self):
        _positive_int("prompts", self.prompts)
        _positive_int("prompt_len", self.prompt_len)
        _positive_int("completion_len", self.completion_len)
        _positive_int("generations", self.generations)
        _choice("workload", self.mode, WORKLOADS)
        if self.token_budget is not None:
            _positive_int("token_budget", self.token_budget)
        _choice("dtype", self.dtype, tuple(DTYPE_BYTES))
        _choice("optimizer", self.optimizer, tuple(OPTIMIZER_STATE_BYTES))
        if self.lora_fraction is not None and not 0 < self.lora_fraction <= 1:
            raise ValueError(f"lora_fraction must be in (0, 1], got {self.lora_fraction}")
        if self.generations_per_chunk is not None and not 1 <= self.generations_per_chunk <= self.generations:
            raise ValueError(
                f"generations_per_chunk must be in [1, G={self.generations}], got {self.generations_per_chunk}"
            )
        if self.scored_tokens is not None and not 0 <= self.scored_tokens <= self.rows * self.completion_len:
            raise ValueError(
                f"scored_tokens must be in [0, B x G x C = {self.rows * self.completion_len}], got {self.scored_tokens}"
            )
        if self.prompt_tokens is not None and not self.prompts <= self.prompt_tokens <= self.prompts * self.prompt_len:
            raise ValueError(
                f"prompt_tokens must be in [B = {self.prompts}, B x P = {self.prompts * self.prompt_len}] "
                f"(every prompt holds 1 to P real tokens), got {self.prompt_tokens}"
            )
        if not self.padded_prompts and self.real_prompt_tokens < self.prompts * self.prompt_len:
            raise ValueError(
                f"padded_prompts=False, but prompt_tokens={self.prompt_tokens} < B x P = "
                f"{self.prompts * self.prompt_len} says some prompt is padded; pass padded_prompts=True"
            )

    @property
    def rows(self) -> int:
        """B x G completion rows."""
        return self.prompts * self.generations

    @property
    def train(self) -> bool:
        """Whether the step computes gradients (``mode="train"``)."""
        return self.mode == "train"

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def scored(self) -> int:
        """Completion tokens the fused heads score."""
        return self.rows * self.completion_len if self.scored_tokens is None else self.scored_tokens

    @property
    def dense_tokens(self) -> int:
        """Tokens a full-row forward computes: B x G x (P + C)."""
        return self.rows * (self.prompt_len + self.completion_len)

    @property
    def real_prompt_tokens(self) -> int:
        """Real tokens of the B distinct prompts: ``prompt_tokens``, or all B x P when it is not given."""
        return self.prompts * self.prompt_len if self.prompt_tokens is None else self.prompt_tokens

    @property
    def dense_row_tokens(self) -> int:
        """Tokens the benchmark's ``dense`` method forwards: each row's real prompt tokens (no prompt pads) and its
        C completion columns, G x real prompt tokens + B x G x C."""
        return self.generations * self.real_prompt_tokens + self.rows * self.completion_len

    @property
    def largest_dense_bucket_rows(self) -> int:
        """Rows of the largest group ``dense`` forwards at once without gradients: prompts of one real length go
        together; with fewer real tokens than B x P the prompts' lengths differ (``bench``'s batches: P down to
        P/2, each length once), so the longest prompt's G rows, else all B x G rows."""
        return self.generations if self.real_prompt_tokens < self.prompts * self.prompt_len else self.rows

    @property
    def shared_tokens(self) -> int:
        """Tokens the shared-prefix forward computes: B x (P + G x C)."""
        return self.prompts * self.prompt_len + self.rows * self.completion_len

    @property
    def chunk_generations(self) -> int:
        """Generations per ``chunked_backward`` chunk."""
        return self.generations_per_chunk or max(1, self.generations // 4)

    def with_generations(self, generations: int) -> Workload:
        """The same workload with G = ``generations`` (scored tokens scaled with the rows, the chunk capped)."""
        scored = None
        if self.scored_tokens is not None:
            scored = self.scored_tokens * generations // self.generations
        chunk = None if self.generations_per_chunk is None else min(self.generations_per_chunk, generations)
        return Workload(
            **{**self.__dict__, "generations": generations, "scored_tokens": scored, "generations_per_chunk": chunk}
        )

    def with_chunk(self, generations_per_chunk: int) -> Workload:
        """The same workload with ``chunked_backward``'s chunk set."""
        return Workload(**{**self.__dict__, "generations_per_chunk": generations_per_chunk})


@dataclass(frozen=True)
class Engine:
    """Where the step runs: one device, or FSDP2 / ZeRO-3 sharding over ``world_size`` devices.

    Attributes:
        kind: ``single``, ``fsdp2`` or ``zero3``.
        world_size: devices sharing the parameters, gradients and optimizer states (1 for ``single``).
        device: ``cuda`` (allocated bytes of a training process) or ``cpu`` (what ``bench --device cpu`` measures).
        memory_bytes: one device's memory, for the "fits" verdict (None: no verdict).
        head_implementation: the fused head's statistics, ``triton`` or ``torch`` (None: ``triton`` on ``cuda``,
            ``torch`` on ``cpu``); CUDA runs the torch one where Triton kernels cannot launch.
        repeats_kv: on ``cuda``, whether the SDPA kernel ``expand`` runs needs a grouped-query model's KV heads
            repeated per query head: True (a kernel without grouped-query support, or the math kernel), False (one
            that takes them natively: cuDNN on sm90, the memory-efficient kernel after torch 2.11). The library asks
            torch which kernel a call gets; the plan cannot, so None (not known) counts the repeated copies (an upper
            bound of the terms) and, without gradients, the larger peak of the two ways the token budget then cuts
            the rows into chunks (a repeat makes a row cost more, so chunks hold fewer rows). Ignored on ``cpu``
            (no fused kernel there).
    """

    kind: str = "single"
    world_size: int = 1
    device: str = "cuda"
    memory_bytes: int | None = None
    extra: dict = field(default_factory=dict)
    head_implementation: str | None = None
    repeats_kv: bool | None = None

    def __post_init__(self):
        _choice("engine", self.kind, ENGINES)
        _positive_int("gpus", self.world_size)
        _choice("device", self.device, DEVICES)
        if self.kind == "single" and self.world_size != 1:
            raise ValueError(f"engine 'single' runs on one device; got gpus={self.world_size} (use fsdp2 or zero3)")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"gpu_memory must be positive, got {self.memory_bytes}")
        if self.repeats_kv is not None and not isinstance(self.repeats_kv, bool):
            raise TypeError(f"repeats_kv must be True, False or None, got {self.repeats_kv!r}")
        if self.head_implementation is not None:
            _choice("head_implementation", self.head_implementation, HEAD_IMPLEMENTATIONS)
            if self.device == "cpu" and self.head_implementation == "triton":
                raise ValueError("head_implementation 'triton' runs on cuda only; bench --device cpu uses 'torch'")

    @property
    def head_statistics(self) -> str:
        """The implementation of the fused head's statistics: ``head_implementation`` or the device's default."""
        return self.head_implementation or ("triton" if self.device == "cuda" else "torch")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_memory_size(text: str, *, option: str = "--gpu-memory") -> int:
    """Bytes of a size with its unit: ``80GB`` (decimal), ``80GiB`` (binary), ``81920MiB``, ``1024B`` (bytes).

    A bare number is refused: ``80`` meant as 80 GB would otherwise be read as 80 bytes.

    Raises:
        ValueError: naming ``option`` when ``text`` is not such a size.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{option}: cannot read {text!r} as a memory size (examples: 80GB, 80GiB, 141GB)")
    if not match.group(2):
        raise ValueError(
            f"{option}: {text!r} has no unit; write it with one, e.g. {text.strip()}GB or {text.strip()}GiB"
        )
    number, unit = float(match.group(1)), match.group(2).lower()
    binary = "i" in unit
    prefix = unit.rstrip("b").rstrip("i")
    scale = 1024 ** "kmgt".index(prefix) * 1024 if binary and prefix else _UNITS[prefix]
    size = int(number * scale)
    if size <= 0:
        raise ValueError(f"{option}: memory size must be positive, got {text!r}")
    return size
