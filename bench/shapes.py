"""LoRA adapter tensor shapes of real models (r x in for A, out x r for B, all linear layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """What a LoRA all-linear adapter of a decoder needs to know about the base model."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    q_out: int
    kv_out: int
    rank: int

    def adapter_shapes(self) -> list[tuple[int, int]]:
        """A and B shapes for q, k, v, o, gate, up, down in every layer."""
        h, i = self.hidden, self.intermediate
        linear = [(h, self.q_out), (h, self.kv_out), (h, self.kv_out), (self.q_out, h),
                  (h, i), (h, i), (i, h)]
        shapes: list[tuple[int, int]] = []
        for _ in range(self.layers):
            for fan_in, fan_out in linear:
                shapes += [(self.rank, fan_in), (fan_out, self.rank)]
        return shapes

    def params(self) -> int:
        """Adapter parameters."""
        return sum(a * b for a, b in self.adapter_shapes())


QWEN3_06B_R16 = ModelShape("qwen3-0.6b r16", 28, 1024, 3072, 2048, 1024, 16)
LLAMA_7B_R16 = ModelShape("llama-7b r16", 32, 4096, 11008, 4096, 4096, 16)
LLAMA3_8B_R64 = ModelShape("llama3-8b r64", 32, 4096, 14336, 4096, 1024, 64)
ALL = [QWEN3_06B_R16, LLAMA_7B_R16, LLAMA3_8B_R64]


def make_adapter(shape: ModelShape, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """Random adapter tensors of the given shapes."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(s, generator=gen) * 0.02).to(dtype) for s in shape.adapter_shapes()]
