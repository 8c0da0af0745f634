"""deepinfer-attention: sliding-window bounded replay and GPU attention backends."""
