"""deepinfer-moe: MoE expert backends for deepinfer (grouped CPU, Triton bf16/FP8, DeepGEMM)."""
