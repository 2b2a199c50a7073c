"""Everything done to a trained checkpoint, without Lightning: decoders (engines, ct2_worker), make tune's grid and
its record (grid, tuned), the end-of-run protocol (protocol)."""
