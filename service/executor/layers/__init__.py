"""The layers Sluice's own models are built of: linears per weight format, RMSNorm, rotary, paged attention, MLP."""
