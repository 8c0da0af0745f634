"""deepinfer-spec-decode: drafters, confidence calibration and verification plans for the core's
speculative decoding (``plugins={"spec_decode": {"enabled": True}}``)."""
