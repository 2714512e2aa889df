"""Real MoE layer shapes the simulator projects to (docs/design.md, "Real model shapes").

Only what the routed-expert side and its router need: hidden size D, expert hidden size F,
routed experts E and top-k K, the shared expert's hidden size, the number of MoE layers. The
layer config is built in bf16, the dtype these models train in.
"""

from __future__ import annotations

from dataclasses import dataclass

from lrmoe.config import MoEConfig


@dataclass(frozen=True)
class ModelSpec:
    """One model's MoE layer shape and depth."""

    name: str
    dim: int  # D
    ffn_dim: int  # F, per routed expert
    num_experts: int  # E
    top_k: int  # K
    shared_ffn_dim: int  # hidden size of the shared expert; 0 without one
    moe_layers: int
    router: str  # "softmax" (Qwen3) or "sigmoid" (GLM-4.5)

    def moe_config(self, dtype: str = "bfloat16") -> MoEConfig:
        """The library's layer config for this shape (what Controller and the cost model read)."""
        return MoEConfig(
            dim=self.dim, ffn_dim=self.ffn_dim, num_experts=self.num_experts, top_k=self.top_k,
            router=self.router, num_shared_experts=1 if self.shared_ffn_dim else 0,
            shared_ffn_dim=self.shared_ffn_dim or None, dtype=dtype,
        )


MODELS: dict[str, ModelSpec] = {
    "qwen3-30b-a3b": ModelSpec("qwen3-30b-a3b", dim=2048, ffn_dim=768, num_experts=128, top_k=8,
                               shared_ffn_dim=0, moe_layers=48, router="softmax"),
    "glm45-air": ModelSpec("glm45-air", dim=4096, ffn_dim=1408, num_experts=128, top_k=8,
                           shared_ffn_dim=1408, moe_layers=45, router="sigmoid"),
}
