"""What a checkpoint on disk holds, as the inspector read it: plain data for every reader.

``checkpoints.inspector`` fills these in from safetensors headers and hashes; the run state,
the detectors and the promotion gate only read them, so they need none of the file code.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Value(str, enum.Enum):
    """An exact value every element of a tensor holds at initialisation."""

    ZERO = "0"
    ONE = "1"


@dataclass(frozen=True)
class TensorFacts:
    """One tensor of a safetensors file."""

    name: str
    dtype: str
    params: int
    nbytes: int
    digest: str
    #: The exact value every element holds, among those the method's identity names
    #: (only computed for the tensors its identity names); None when it is neither.
    constant: Value | None = None


@dataclass(frozen=True)
class CheckpointInspection:
    """What a checkpoint folder (or a single weights file) holds."""

    path: str
    weights_file: str = ""
    is_adapter: bool = False
    adapter_digest: str = ""
    tensor_digests: dict[str, str] = field(default_factory=dict)
    #: Tensors in the weights file (kept when an old checkpoint drops its digest map).
    tensor_count: int = 0
    tensor_bytes: int = 0
    #: The PEFT method (``peft_type``) the adapter was saved by, from its config or names.
    method: str = ""
    #: The method's untrained identity, readable (``lora_B=0``).
    identity: str = ""
    adapter_tensors: int = 0
    adapter_params: int = 0
    #: Adapted modules whose tensors the method's identity can judge, and how many of them
    #: left it (were trained): 0 of N means the adapter changes nothing.
    identity_modules: int = 0
    moved_modules: int = 0
    #: Tensors saved in an adapter that are not the method's own: (name, params).
    non_adapter: tuple[tuple[str, int], ...] = ()
    #: Tensors with no element at all (shape with a 0), as ZeRO-3/FSDP saves write them.
    empty_tensors: tuple[str, ...] = ()
    pickle_files: tuple[str, ...] = ()

    @property
    def non_adapter_params(self) -> int:
        return sum(p for _, p in self.non_adapter)
