"""deepinfer-scheduling: the overlapped (zero-overhead) step executor and scheduling policies."""
